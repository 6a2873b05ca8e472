"""A server engine's staging folder: the files its server writes there, read under their locks and deleted; what
is left of crashed runs, cleared; the build's own subfolder (`staging_name`), removed when a run ends; the room on
the staging volume, and whether a file of a given size can ever fit on it.

A staging file is `{uuid}.safetensors` beside a `.lock` the server holds (flock) until the file is complete; what
the file holds is the engine's (its backend validates it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from pathlib import Path

from builder.extract.backends.http_client import EngineUnavailable
from builder.humanize import human_bytes

STAGING_SUFFIX = ".safetensors"
STAGING_PREFIX = "build-"  # a build's own subfolder of the server's staging folder: build-<id>


def staging_name(meta: dict) -> str:
    """The build's own subfolder of the staging folder, named by the build's id (a digest of when and from what
    `init` made it: the same for every run of the build, another after `init --force`)."""
    raw = f"{meta.get('created_at')!r}|{meta.get('config_fingerprint')}|{meta.get('source')}"
    return STAGING_PREFIX + hashlib.sha256(raw.encode()).hexdigest()[:16]


def remove_staged(path: Path | str) -> None:
    """Delete a staging file and its lock (either may be gone already)."""
    for q in (Path(path), Path(str(path) + ".lock")):
        q.unlink(missing_ok=True)


def staging_usage(staging: Path) -> tuple[int, int]:
    """(files, bytes) in the staging folder now."""
    files = size = 0
    for p in staging.glob("*" + STAGING_SUFFIX):
        try:
            size += p.stat().st_size
            files += 1
        except FileNotFoundError:
            pass
    return files, size


def clear_staging(staging: Path) -> int:
    """Remove staging files (and lone lock files) no server is writing (their lock can be taken): what crashed
    runs left in this folder, a build's own. Returns how many files were removed. Files whose lock is held belong
    to a request still being written; left alone."""
    removed = 0
    if not staging.is_dir():
        return 0
    names = {p.name.removesuffix(".lock") for p in staging.glob("*" + STAGING_SUFFIX + ".lock")}
    names |= {p.name for p in staging.glob("*" + STAGING_SUFFIX)}
    for name in sorted(names):
        p = staging / name
        lock = Path(str(p) + ".lock")
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
            removed += p.exists()
            remove_staged(p)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def remove_build_folder(staging: Path) -> bool:
    """Remove a build's own staging subfolder (`build-<id>`, made by its run) once it is empty: what its runs left
    there is cleared first (`clear_staging`), so a run leaves nothing behind in the staging folder. A subfolder
    still holding something (a file a server is writing, anything not a staging file) stays, and so does a mount
    point or one that cannot be removed: nothing that is not the build's is ever removed. Returns whether it was."""
    if not staging.name.startswith(STAGING_PREFIX) or not staging.is_dir() or os.path.ismount(staging):
        return False
    clear_staging(staging)
    with contextlib.suppress(OSError):  # not empty, busy, or gone: left as it is
        staging.rmdir()
        return True
    return False


def volume_room(path: Path) -> tuple[int, int]:
    """(free bytes an unprivileged writer gets, total bytes) of the volume holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def volume_capacity(path: Path) -> int:
    """The most bytes an unprivileged writer can ever have free on the volume holding `path`: its size less the
    blocks reserved for root (none on a tmpfs), i.e. its free space were it empty."""
    st = os.statvfs(path)
    return (st.f_blocks - (st.f_bfree - st.f_bavail)) * st.f_frsize


def never_fits(staging: Path, tokens: int, least: int) -> str | None:
    """Why a staging file of `tokens` tokens (at least `least` bytes, as its engine counts them) can never be written
    into `staging` (a build's subfolder of the staging folder), whose volume is smaller than that even when empty
    (one line: the size it needs, the size the volume has, what to change); None when it can be, or the volume
    cannot be measured."""
    try:
        capacity = volume_capacity(staging)
    except OSError:
        return None
    if least <= capacity:
        return None
    return (f"the staging folder {staging.parent} is on a volume of {capacity} bytes ({human_bytes(capacity)}), "
            f"smaller than one {tokens}-token staging file (at least {least} bytes, {human_bytes(least)}): it can "
            "never be staged there, even with the volume empty; give the build a staging folder on a bigger volume "
            "(`staging` in hsbuild.toml, `--staging` at init), serve from it (the command `hsbuild serve-command "
            "BUILD` prints), then `hsbuild resume BUILD`")


def read_when_ready(path: Path | str, timeout: float, wait=lambda s: time.sleep(min(s, 0.05))) -> dict:
    """Wait until the server released the staging file's lock (`wait(seconds)` sleeps until something may
    have changed: the backend's watchdog wakeup), then read it. A file is read only under its lock, held shared:
    one without a lock file is never taken as complete. EngineUnavailable when the server died before the file
    was complete, never wrote it, or writes without locks."""
    from safetensors.torch import load  # noqa: PLC0415

    path = Path(path)
    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                if path.exists():
                    raise EngineUnavailable(f"{path}: there is no lock file beside it after {timeout:g} s, so "
                                            "nothing says it is complete (does the server run with "
                                            "use_synchronization_lock off?); hsbuild never reads such a file") \
                        from None
                raise EngineUnavailable(f"{path}: never appeared in the staging folder within {timeout:g} s "
                                        "(did the server die?)") from None
            wait(0.2)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"{path}: still locked by the server after {timeout:g} s") from None
                wait(0.2)
                continue
            if not path.exists():  # lock released but no file: the writer died, or its write failed
                raise EngineUnavailable(f"{path}: the server released its lock without writing the file (it "
                                        "died, or its write failed)")
            try:
                raw = path.read_bytes()
            except OSError as e:  # gone between the check and the read, or unreadable: the engine's side failed
                raise EngineUnavailable(f"{path}: could not be read ({type(e).__name__}: {e})") from None
        finally:
            os.close(fd)
        try:
            return load(raw)
        except Exception as e:  # noqa: BLE001 - a torn file (writer killed mid-write, or out of space)
            raise EngineUnavailable(f"{path}: unreadable ({type(e).__name__}: {e}); the server's write was cut "
                                    "short") from None


def read_and_remove(path: Path | str, timeout: float, wait=lambda s: time.sleep(min(s, 0.05))) -> dict:
    """`read_when_ready`, then the staging file and its lock are deleted (also when reading failed)."""
    try:
        return read_when_ready(path, timeout, wait)
    finally:
        remove_staged(path)
