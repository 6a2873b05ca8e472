"""Storage stalls: writes that never return.

A Ceph pool or a thin volume that runs out of space does not answer ENOSPC: writes and fsyncs simply stop
returning (the writer sits in state `D`), while reads and `statfs` go on and the filesystem still shows free
space, so watermarks cannot see it (the incident in `seeds/`). `StallWatch` notices it two ways:

- **tracked operations**: the owner wraps its own writes, fsyncs and log commits in `track(what, path)`;
- **probes**: a daemon thread writes and fsyncs one byte of a small probe file in each watched directory every
  `probe_every` seconds (one probe at a time per directory: a stuck one is never piled on). That covers what
  other processes (the workers) write there.

Whatever has been pending for `limit_s` (HSBUILD_STALL_S, default 30) makes the volume `stalled`: `current()`
says what, on which path and filesystem, since when; `on_change(stall, cleared_after)` is called (from the
watch thread) when a stall begins and when it ends. Nothing here fails a sample or raises: a stall is waited
out. A thread stuck in the kernel cannot be interrupted: the probe threads are daemon threads.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from builder.mounts import mount_of

DEFAULT_STALL_S = 30.0
PROBE_NAME = ".hsbuild-stall-probe"


def stall_limit() -> float:
    """HSBUILD_STALL_S (seconds; default 30): how long a write may be pending before the volume is stalled."""
    try:
        v = float(os.environ.get("HSBUILD_STALL_S", DEFAULT_STALL_S))
    except ValueError:
        return DEFAULT_STALL_S
    return v if v > 0 else DEFAULT_STALL_S


def filesystem_of(path: Path | str, mounts_text: str | None = None, resolve: bool = True) -> str:
    """`fstype at mount point` of the mount holding `path`, or '?' (`resolve`: see mounts.mount_entry)."""
    m = mount_of(path, mounts_text, resolve)
    return f"{m.fstype} at {m.mount_point}" if m is not None else "?"


@dataclass(frozen=True)
class Stall:
    what: str  # "log commit", "write probe", "fsync", ...
    path: str
    filesystem: str
    since: float  # time.monotonic() when the oldest pending operation began
    since_wall: float  # time.time() of the same moment

    def pending_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since

    def describe(self, now: float | None = None) -> str:
        return f"{self.what} pending {self.pending_s(now):.0f} s on {self.path} ({self.filesystem})"

    def as_dict(self, now: float | None = None) -> dict:
        return {"what": self.what, "path": self.path, "filesystem": self.filesystem,
                "pending_s": round(self.pending_s(now), 1), "since": self.since_wall}


@dataclass
class _Op:
    what: str
    path: str
    t0: float
    wall: float = field(default_factory=time.time)


class StallWatch:
    def __init__(self, dirs: list[Path], limit_s: float | None = None, probe_every: float = 5.0,
                 on_change: Callable[[Stall | None, Stall | None], None] | None = None, tick: float = 0.5):
        """`dirs`: the directories to probe (the build's root, its data, the staging folder); `on_change(new,
        old)`: a stall began (new set) or ended (new None, old the one that ended)."""
        self.dirs = [Path(d) for d in dict.fromkeys(dirs)]
        self.limit = stall_limit() if limit_s is None else limit_s
        self.probe_every, self.tick = probe_every, tick
        self.on_change = on_change
        self._fs = {str(d): filesystem_of(d) for d in self.dirs}
        self._ops: dict[int, _Op] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._probing: dict[str, int] = {}  # dir -> the op id of its pending probe
        self._last_probe: dict[str, float] = {}
        self._stall: Stall | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the owner does -------------------------------------------------------------------------------
    @contextmanager
    def track(self, what: str, path: Path | str) -> Iterator[None]:
        """Wrap one write, fsync or commit: pending until it returns (or raises)."""
        op_id = self._begin(what, str(path))
        try:
            yield
        finally:
            self._end(op_id)

    def current(self) -> Stall | None:
        with self._lock:
            return self._stall

    def pending(self, what: str) -> Stall | None:
        """The oldest tracked `what` (e.g. "log commit") still pending, however young (a stall or not yet):
        what a reader of the log may be waiting behind."""
        with self._lock:
            oldest = min((o for o in self._ops.values() if o.what == what), key=lambda o: o.t0, default=None)
        if oldest is None:
            return None
        return Stall(oldest.what, oldest.path, self.filesystem(oldest.path), oldest.t0, oldest.wall)

    @property
    def stalled(self) -> bool:
        return self.current() is not None

    def filesystem(self, path: Path | str) -> str:
        p = str(path)
        for d, fs in self._fs.items():
            if p == d or p.startswith(d.rstrip("/") + "/"):
                return fs
        return filesystem_of(p, resolve=False)  # (no lookup on a volume that may be stalled)

    def start(self) -> StallWatch:
        self._thread = threading.Thread(target=self._loop, name="hsbuild-stall-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, and remove the probe files (those not held by a probe still pending)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        for d in self.dirs:
            with self._lock:
                pending = str(d) in self._probing
            if not pending and str(d) in self._last_probe:
                try:
                    os.unlink(os.path.join(str(d), PROBE_NAME))
                except OSError:
                    pass

    # -- inside -------------------------------------------------------------------------------------------
    def _begin(self, what: str, path: str) -> int:
        op_id = next(self._ids)
        with self._lock:
            self._ops[op_id] = _Op(what, path, time.monotonic())
        return op_id

    def _end(self, op_id: int) -> None:
        with self._lock:
            self._ops.pop(op_id, None)

    def _probe(self, d: str, op_id: int) -> None:
        try:
            fd = os.open(os.path.join(d, PROBE_NAME), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, b"\0", 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # (a probe that fails is no stall: ENOSPC and EIO have their own paths)
        finally:
            self._end(op_id)
            with self._lock:
                self._probing.pop(d, None)

    def _start_probes(self, now: float) -> None:
        for d in self.dirs:
            key = str(d)
            with self._lock:
                if key in self._probing or now - self._last_probe.get(key, -1e9) < self.probe_every:
                    continue
                self._last_probe[key] = now
            op_id = self._begin("write probe", os.path.join(key, PROBE_NAME))
            with self._lock:
                self._probing[key] = op_id
            threading.Thread(target=self._probe, args=(key, op_id), name="hsbuild-stall-probe", daemon=True).start()

    def check(self, now: float | None = None) -> Stall | None:
        """Recompute the stall state (the watch thread does it every `tick`); calls on_change on a change."""
        now = time.monotonic() if now is None else now
        with self._lock:
            oldest = min(self._ops.values(), key=lambda o: o.t0, default=None)
        fs = self.filesystem(oldest.path) if oldest is not None and now - oldest.t0 >= self.limit else None
        with self._lock:
            old = self._stall
            if oldest is not None and fs is not None:
                new = Stall(oldest.what, oldest.path, fs, oldest.t0, oldest.wall)
                if old is not None and (old.what, old.path, old.since) == (new.what, new.path, new.since):
                    new = old
                elif old is not None:  # the same stall goes on: it began with the first operation that hung
                    new = Stall(new.what, new.path, new.filesystem, min(old.since, new.since),
                                min(old.since_wall, new.since_wall))
            else:
                new = None
            self._stall = new
        if (old is None) != (new is None) and self.on_change is not None:
            self.on_change(new, old)
        return new

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            self._start_probes(now)
            try:
                self.check(now)
            except Exception:  # noqa: BLE001, S112 - the watch must outlive a failing callback
                continue
