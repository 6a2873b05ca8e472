"""Storage awareness: disk-usage watermarks with hysteresis, a ballast file for the event log, capacity planning.

- `high` (default 0.90): writers pause once usage reaches it; they resume only below `low` (0.85).
- `flood` (0.95): a write whose projected size would cross it is not started.
- `min_free`: absolute free bytes that must remain (a pause like `high`).
- A real ENOSPC anyway (another process filled the volume, or the filesystem lied): the write is abandoned and
  retried later, writers pause, and the ballast file next to the log is released so the log can still commit.

The ballast (`BUILD/.ballast`, created by a run) is sized by `ballast_target`: what the event log needs to keep
committing through a full disk, never more than 1% of the volume, and within 1-64 MiB (docs/design.md, section 7).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from builder.config import BuildConfig
from builder.errors import WontFitError
from builder.humanize import human_bytes, pct
from builder.layout import BuildLayout
from builder.log.events import CHECKPOINT_BYTES

POLL_SECONDS = 0.25
BALLAST_MIN, BALLAST_MAX = 1 << 20, 64 << 20
BALLAST_VOLUME_SHARE = 0.01  # never more than this share of the volume (a small volume keeps its room)
# What the event log needs, measured on DuckDB 1.x (docs/design.md, section 7): a commit appends to the WAL
# (about 150 B per event, 3-4 events per sample, plus run-level events: pauses, GPU samples), and once the WAL
# holds CHECKPOINT_BYTES a checkpoint writes the log's blocks anew before it frees the WAL: a checkpoint that
# finds no free block is fatal to DuckDB's connection. A log holds about 2.3 MiB once a run has checkpointed it
# (tables, indexes), then about 30 B more per sample (256 B is the bound used here).
LOG_WAL_BASE = 1 << 20
LOG_WAL_PER_SAMPLE = 1 << 10
LOG_FILE_BASE = 5 << 19  # 2.5 MiB
LOG_FILE_PER_SAMPLE = 256
BALLAST_PURPOSE = ("reserved space, released when the disk fills so the event log can still commit; re-created "
                   "when space returns")


def log_bytes(lay: BuildLayout) -> int:
    """The event log's size on disk now (the database file and its WAL)."""
    total = 0
    for p in (lay.events, lay.wal):
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def ballast_target(volume_bytes: int, log_now: int, remaining_samples: int = 0) -> int:
    """The ballast's size: twice what the log can need to commit the rest of the build on a full disk (its WAL
    up to the next checkpoint, and that checkpoint rewriting the log as it will end), at most 1% of the volume,
    and within BALLAST_MIN-BALLAST_MAX. A small build gets a few MiB, a small volume 1% of itself (at least
    1 MiB: a few thousand events), a large build on a large volume 64 MiB."""
    wal = min(CHECKPOINT_BYTES, LOG_WAL_BASE + remaining_samples * LOG_WAL_PER_SAMPLE)
    log_end = max(log_now, LOG_FILE_BASE) + remaining_samples * LOG_FILE_PER_SAMPLE
    need = -(-2 * (wal + log_end) // BALLAST_MIN) * BALLAST_MIN  # whole MiB
    return max(BALLAST_MIN, min(BALLAST_MAX, int(volume_bytes * BALLAST_VOLUME_SHARE), need))


def ballast_info(lay: BuildLayout) -> dict:
    """What `status` shows: the ballast's bytes on disk now (0: none, e.g. released on a full disk or no run
    yet), its path and what it is for."""
    try:
        n = lay.ballast.stat().st_size
    except OSError:
        n = 0
    return {"ballast_bytes": n, "ballast_path": str(lay.ballast), "ballast_purpose": BALLAST_PURPOSE}


@dataclass
class Usage:
    path: str
    total: int
    free: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 1.0


def disk_usage(path: Path) -> Usage:
    st = os.statvfs(path)
    return Usage(str(path), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def estimate_bytes_per_token(meta: dict) -> float:
    """Uncompressed bytes a token needs (an upper bound before the first write)."""
    h = int(meta.get("hidden_size", 0))
    n_aux = len(meta.get("aux_layers", []))
    if meta.get("quantize"):  # fp8: a byte a value and a float32 scale a token, per state field
        return (n_aux + 1) * h + 2 * 4 + 5
    width = 4 if meta.get("dtype") == "float32" else 2
    return (n_aux + 1) * h * width + 5


GROUP_FILES = 5  # a group of samples is 4 shard files and a manifest
SAMPLES_PER_GROUP = 8  # a conservative guess before the first write (small samples group far more)
MANIFEST_BYTES_PER_SAMPLE = 400


def estimate_bytes_per_sample(meta: dict, block: int) -> float:
    """What a sample costs on disk beyond its tokens, before anything is measured: its last chunk padded to
    full length (uncompressed bound), its manifest entry, and its share of its group's per-file block
    rounding."""
    chunk = int(meta.get("chunk_tokens", 1))
    padding = (chunk - 1) / 2 * estimate_bytes_per_token(meta)
    return padding + MANIFEST_BYTES_PER_SAMPLE + GROUP_FILES * block / SAMPLES_PER_GROUP


class SpaceMonitor:
    def __init__(self, lay: BuildLayout, cfg: BuildConfig):
        self.lay, self.wm = lay, cfg.watermarks
        self.paths = [lay.root]
        if cfg.staging and Path(cfg.staging).is_dir():  # a missing one is doctor's FAIL (storage.staging)
            self.paths.append(Path(cfg.staging))
        self._paused: str | None = None
        self._which = 0  # the index in `paths` of the volume that paused it (0: the build's, 1: staging)
        self._last_poll = 0.0
        self._usage: list[Usage] = [disk_usage(p) for p in self.paths]
        self._full_at: float | None = None
        self._free_at_full = 0
        self._data_free_at_full = 0
        self._flood_need = 0
        self.bytes_written = 0
        self.tokens_written = 0
        self.bytes_per_token: float | None = None
        self.remaining_samples = 0
        self.ballast_size = self.size_ballast()

    def size_ballast(self, remaining_samples: int | None = None) -> int:
        """(Re)compute the ballast's size for the log as it is now and the samples still to do."""
        if remaining_samples is not None:
            self.remaining_samples = remaining_samples
        self.ballast_size = ballast_target(self._usage[0].total, log_bytes(self.lay), self.remaining_samples)
        return self.ballast_size

    # -- figures ----------------------------------------------------------------------------------------
    def refresh(self) -> list[Usage]:
        self._usage = [disk_usage(p) for p in self.paths]
        return self._usage

    def snapshot(self) -> dict:
        u = self._usage[0]
        out = {"free_bytes": u.free, "total_bytes": u.total, "usage": round(u.usage, 4), "low": self.wm.low,
               "high": self.wm.high, "flood": self.wm.flood, "min_free": self.wm.min_free}
        if len(self._usage) > 1:
            s = self._usage[1]
            out.update(staging_free_bytes=s.free, staging_usage=round(s.usage, 4))
        return out

    def describe(self) -> str:
        """The volume the pause is about (the staging volume when that one crossed a watermark), else the
        build's."""
        i = self._which if self._paused in ("min_free", "high_watermark") and self._which < len(self._usage) else 0
        u = self._usage[i]
        return (f"{'staging ' if i else ''}{u.path} {u.usage:.1%} used, {human_bytes(u.free)} free "
                f"(low {pct(self.wm.low)}, high {pct(self.wm.high)}, flood {pct(self.wm.flood)})")

    def account(self, nbytes: int, tokens: int) -> None:
        self.bytes_written += nbytes
        self.tokens_written += tokens
        if self.tokens_written:
            self.bytes_per_token = self.bytes_written / self.tokens_written

    # -- pausing ----------------------------------------------------------------------------------------
    def poll(self, force: bool = False) -> str | None:
        """Pause reason, or None to write. Hysteresis: pause at `high`, resume below `low`."""
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_SECONDS:
            return self._paused
        self._last_poll = now
        usages = self.refresh()
        if self._paused is None:
            for i, u in enumerate(usages):
                if self.wm.min_free and u.free < self.wm.min_free:
                    self._paused, self._which = "min_free", i
                elif self.wm.high < 1.0 and u.usage >= self.wm.high:  # 1.0: off, as for flood (a full
                    self._paused, self._which = "high_watermark", i  # volume then pauses by the disk-full path)
                if self._paused is not None:
                    break
        else:
            clear = all(u.usage < self.wm.low and not (self.wm.min_free and u.free < self.wm.min_free)
                        for u in usages)
            if self._flood_need and clear:  # a held-back write (flood_block): it must fit below flood too
                u = usages[0]
                clear = (u.used + self._flood_need) / u.total < self.wm.flood
            if self._paused == "disk_full" and clear:
                # the filesystem said "full" although figures looked fine: wait for visible new space
                # (on the build's volume, or on data/'s when that is a mount of its own)
                clear = now - (self._full_at or 0) > 2.0 and (usages[0].free > self._free_at_full
                                                              or self._data_free() > self._data_free_at_full)
            if clear:
                self._paused = None
                self._full_at = None
                self._flood_need = 0
                self.ensure_ballast()
        return self._paused

    def disk_full(self) -> None:
        self.refresh()
        self._paused = "disk_full"
        self._full_at = time.monotonic()
        self._free_at_full = self._usage[0].free
        self._data_free_at_full = self._data_free()
        self.release_ballast()

    def _data_free(self) -> int:
        try:
            return disk_usage(self.lay.data).free
        except OSError:
            return 0

    def flood_block(self, projected: int) -> None:
        """A worker did not start a write that would have crossed `flood`: pause until it fits again. Where the
        build's volume is past `high` already, the run's own poll had not seen it yet (a worker's check is
        conservative and can come first): that is the high watermark's pause, named so, and like it it lasts
        until the volume is below `low` (and the write fits below `flood`)."""
        u = self.refresh()[0]
        self._flood_need = projected
        past_high = self.wm.high < 1.0 and u.usage >= self.wm.high
        self._paused, self._which = ("high_watermark" if past_high else "flood"), 0

    def never_fits(self, projected: int, total: int, free: int) -> int | None:
        """A write of `projected` bytes was held back at `flood`/`min_free` on a volume of `total` bytes with
        `free` left. Would it be held back even if this run had written nothing (its samples and the ballast
        freed)? Then it can never be written while the other files stay: returns the room it would have had
        (bytes); else None (it waits for space like any other write)."""
        ballast = self.lay.ballast.stat().st_size if self.lay.ballast.exists() else 0
        others = max(0, total - free - self.bytes_written - ballast)
        over_flood = self.wm.flood < 1.0 and (others + projected) / total >= self.wm.flood
        under_min_free = self.wm.min_free > 0 and total - others - projected < self.wm.min_free
        if not (over_flood or under_min_free):
            return None
        rooms = []
        if self.wm.flood < 1.0:
            rooms.append(int(total * self.wm.flood) - others)
        if self.wm.min_free > 0:
            rooms.append(total - others - self.wm.min_free)
        return max(0, min(rooms))

    # -- ballast ------------------------------------------------------------------------------------------
    def ensure_ballast(self) -> None:
        """Create or grow the ballast to its size; one more than twice that (an older version's 64 MiB on a
        small build) is shrunk in place."""
        b = self.lay.ballast
        try:
            have = b.stat().st_size if b.exists() else 0
            if have > 2 * self.ballast_size:
                os.truncate(b, self.ballast_size)
                return
            if have >= self.ballast_size:
                return
            u = disk_usage(self.lay.root)
            if u.free < 4 * self.ballast_size or u.usage >= self.wm.high:
                return
            fd = os.open(b, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.ballast_size)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            b.unlink(missing_ok=True)

    def release_ballast(self) -> None:
        self.lay.ballast.unlink(missing_ok=True)

    def before_commit(self) -> None:
        """Make sure the event log can commit: release the ballast when space is nearly gone."""
        u = disk_usage(self.lay.root)
        if u.free < 2 * self.ballast_size:
            self.release_ballast()

    # -- capacity planning ------------------------------------------------------------------------------------
    def projection(self, remaining_tokens: int, meta: dict, measured_bpt: float | None,
                   remaining_samples: int = 0) -> dict:
        """Bytes the rest of the build will take on disk. Measured: allocated bytes per token of what is written
        (block rounding, shard indices and manifests included). Before that: the uncompressed bound plus each
        sample's padding and per-file costs.

        Pure: it reads the volume's figures and changes nothing, neither this monitor (its ballast size, its
        figures) nor the ballast file. A live run's `status` computes it from the query thread while the run's
        own thread manages the monitor; `preflight` sizes the ballast itself."""
        bpt = measured_bpt or estimate_bytes_per_token(meta)
        need = int(remaining_tokens * bpt)
        if not measured_bpt:
            need += int(remaining_samples * estimate_bytes_per_sample(meta, self.block_size))
        u = disk_usage(self.lay.root)
        ballast = ballast_target(u.total, log_bytes(self.lay), remaining_samples)
        try:
            ballast_now = self.lay.ballast.stat().st_size
        except OSError:
            ballast_now = 0
        limit = int(u.total * self.wm.high) - (u.used - ballast_now) - ballast
        return {"remaining_tokens": remaining_tokens, "bytes_per_token": round(bpt, 1),
                "basis": "measured" if measured_bpt else "estimate (uncompressed)", "projected_bytes": need,
                "free_bytes": u.free, "total_bytes": u.total, "room_below_high": limit, "fits": need <= limit}

    @property
    def block_size(self) -> int:
        try:
            return os.statvfs(self.lay.root).f_bsize or 4096
        except OSError:
            return 4096

    def preflight(self, remaining_tokens: int, meta: dict, measured_bpt: float | None, allow_overcommit: bool,
                  echo, remaining_samples: int = 0) -> dict:
        """Refuse (WontFitError) a run whose projected size does not fit below `high`, unless overcommitting."""
        self.size_ballast(remaining_samples)  # the run's ballast, for the samples it starts with
        p = self.projection(remaining_tokens, meta, measured_bpt, remaining_samples)
        if not p["fits"]:
            msg = (f"projected {human_bytes(p['projected_bytes'])} more ({p['basis']}: {p['bytes_per_token']} B/token) "
                   f"but only {human_bytes(max(p['room_below_high'], 0))} fit below the high watermark "
                   f"({pct(self.wm.high)}) on {self.lay.root}")
            if not allow_overcommit:
                raise WontFitError(msg + "; free space, move the build, or pass --allow-overcommit to pause at "
                                         "the watermark instead")
            echo(f"warning: {msg}; continuing (--allow-overcommit): writers will pause at the watermark")
        else:
            echo(f"capacity: {human_bytes(p['projected_bytes'])} more projected ({p['basis']}, "
                 f"{p['bytes_per_token']} B/token); {human_bytes(p['free_bytes'])} free; fits below the high "
                 f"watermark ({pct(self.wm.high)})")
        self.ensure_ballast()
        return p
