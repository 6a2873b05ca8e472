"""The build lock: one owner of the event log at a time.

`hsbuild.lock` is held with flock(2) by the owner (a run, a verify sweep, gc). The kernel releases the flock
when the owner dies, even by SIGKILL, so a lock file whose flock is free is stale and safe to take over; its
JSON content still names the dead owner, which `doctor` reports. A clean exit empties the file.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from builder.errors import BuildLockedError, BuildReadOnlyError
from builder.layout import BuildLayout


def socket_path_for(lay: BuildLayout) -> Path:
    p = lay.root / "hsbuild.sock"
    if len(str(p)) < 100:
        return p
    h = hashlib.blake2b(str(lay.root).encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / f"hsbuild-{h}.sock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class LockState:
    held: bool  # a live process holds the flock
    info: dict | None  # the lock file's content (owner of the live lock, or the dead one)

    @property
    def stale(self) -> bool:
        return not self.held and bool(self.info)


def inspect_lock(lay: BuildLayout) -> LockState:
    try:
        fd = os.open(lay.lock, os.O_RDONLY)
    except FileNotFoundError:
        return LockState(False, None)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held = False
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held = True
        raw = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        info = json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError:
        info = None
    return LockState(held, info)


class BuildLock:
    """Exclusive ownership of a build. Use as a context manager."""

    def __init__(self, lay: BuildLayout, purpose: str, run_id: str | None = None):
        self.lay, self.purpose, self.run_id = lay, purpose, run_id
        self.fd: int | None = None
        self.previous: dict | None = None  # content left by a dead owner, if any
        self.socket_path = socket_path_for(lay)

    def acquire(self) -> BuildLock:
        try:
            fd = os.open(self.lay.lock, os.O_RDWR | os.O_CREAT, 0o644)
            if not os.access(self.lay.root, os.W_OK | os.X_OK):  # the lock file may be writable, its dir not
                os.close(fd)
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.lay.root))
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise BuildReadOnlyError(
                f"{self.lay.root}: not writable ({e.strerror}), so `{self.purpose}` cannot own it; remount the "
                "volume read-write or fix its permissions (`hsbuild status`/`sql`/`doctor` still read it)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            st = inspect_lock(self.lay)
            who = st.info or {}
            raise BuildLockedError(
                f"{self.lay.root}: busy: {who.get('purpose', 'another process')} (pid {who.get('pid', '?')}) owns "
                "this build; watch it with `hsbuild status`, or wait for it to finish"
            ) from None
        raw = os.pread(fd, 65536, 0)
        try:
            self.previous = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            self.previous = None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose, "run_id": self.run_id,
                "started_at": time.time(), "socket": str(self.socket_path)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self, keep_previous: bool = False) -> None:
        """Release; `keep_previous` puts a dead owner's record back (for a short look by `doctor`, so the next
        run still reports whom it took over from)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            if keep_previous and self.previous:
                os.pwrite(self.fd, json.dumps(self.previous).encode(), 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BuildLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
