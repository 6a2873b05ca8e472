"""An export's target volume (builder/exchange/export.py): the projected size checked up front against the high
watermark, and the pause before each file while the volume is at its watermarks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import Watermarks
from builder.errors import Interrupted, UsageError, WontFitError
from builder.formats.build_info import BuildInfo
from builder.humanize import human_bytes, pct
from builder.mounts import mount_of
from builder.progress import Progress
from builder.space.watermarks import Usage, disk_usage
from builder.store.dtypes import itemsize

if TYPE_CHECKING:
    from builder.exchange.export import ExportOptions


def bytes_per_token(info: BuildInfo) -> int:
    return (info.n_aux + 1) * info.hidden_size * itemsize(info.dtype) + 16  # the states, int64 ids and mask


def existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def volume_of(path: Path) -> str:
    """`the tmpfs volume at /mnt/x` (the mount holding `path`), or `the volume of PATH` where it is not known."""
    m = mount_of(path)
    return f"the {m.fstype} volume at {m.mount_point}" if m is not None else f"the volume of {path}"


def check_target(out: Path) -> None:
    """OUT must be a directory, or be creatable as one, on a volume that stores files and that this process may
    write: one line naming the path and what to do otherwise (UsageError, exit 2)."""
    base = existing(out)
    if not base.is_dir():
        raise UsageError(f"{out}: {base} is not a directory; export into a directory (new or empty, or an earlier "
                         "export of the same options)")
    st = os.statvfs(base)
    if st.f_blocks == 0:  # proc, sysfs, cgroup...: no room at all, files there are the kernel's
        raise UsageError(f"{out}: {volume_of(base)} stores no files (a kernel filesystem, 0 bytes); export into a "
                         "directory on a disk")
    if st.f_flag & os.ST_RDONLY or not os.access(base, os.W_OK | os.X_OK):
        why = "mounted read-only" if st.f_flag & os.ST_RDONLY else "no write permission"
        raise UsageError(f"{out}: cannot write in {base} ({why}); export into a directory you can write")


def preflight(out: Path, projected: int, wm: Watermarks, opts: ExportOptions) -> None:
    """Refuse an export whose projected size would take the target volume past `high` (exit 3), unless
    --allow-overcommit (then it pauses at the watermarks as it goes)."""
    if opts.allow_overcommit or not projected:
        return
    u = disk_usage(existing(out))
    if (u.used + projected) / u.total < wm.high:
        return
    room = max(0, int(u.total * wm.high) - u.used)
    raise WontFitError(f"{out}: the export needs about {human_bytes(projected)} but its volume has "
                       f"{human_bytes(room)} below the high watermark ({wm.high:.0%}); free space, export "
                       "a part (--subset/--limit), or pass --allow-overcommit to pause at the watermarks instead")


def wait_for_space(out: Path, size: int, wm: Watermarks, opts: ExportOptions, progress: Progress,
                   pending: int = 0, settle: Callable[[], None] | None = None) -> int:
    """Pause (polling) while the target volume is at `high`, or while this file (and the `pending` bytes of files
    being written) would cross `flood`; until usage is under `low` again. Where it would pause, the files being
    written are first waited for (`settle`) and the volume looked at again. Returns 1 if it paused. Never pauses
    under --allow-overcommit's preflight alone. A pause is said once through `opts.echo` (which volume, how
    full, when it resumes), and so is its end."""
    def fits(u: Usage, under: float) -> bool:  # usage below `under`, and this file neither crosses flood nor min_free
        need = size + pending
        return u.usage < under and (u.used + need) / u.total < wm.flood and (not wm.min_free or u.free - need >= wm.min_free)

    u = disk_usage(out)
    if fits(u, wm.high):
        return 0
    if pending and settle is not None:  # the files in flight written first: then only this one counts
        settle()
        pending = 0
        u = disk_usage(out)
        if fits(u, wm.high):
            return 0
    if size > u.total * wm.flood:
        raise WontFitError(f"{out}: one file of {human_bytes(size)} cannot fit below the flood watermark of its "
                           "volume even if it were empty; export to a bigger volume")
    volume, t0 = volume_of(out), time.monotonic()
    echo: Callable[[str], None] = opts.echo
    echo(f"PAUSED (space): {volume} holds {out}: {_describe(u, wm)}; the export resumes by itself below the low "
         "watermark (free space there)")
    while True:
        progress.update(note=f"paused: {out} volume at {u.usage:.0%} (resumes below {wm.low:.0%})")
        if opts.stop():
            raise Interrupted(f"export into {out} interrupted while paused for space; run it again to finish")
        time.sleep(1.0)
        u = disk_usage(out)
        if fits(u, wm.low):
            echo(f"resumed after {time.monotonic() - t0:.0f} s: {volume}: {_describe(u, wm)}")
            return 1


def _describe(u: Usage, wm: Watermarks) -> str:
    return (f"{u.usage:.1%} used, {human_bytes(u.free)} free (low {pct(wm.low)}, high {pct(wm.high)}, flood "
            f"{pct(wm.flood)}" + (f", min_free {human_bytes(wm.min_free)}" if wm.min_free else "") + ")")
