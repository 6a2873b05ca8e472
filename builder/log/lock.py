"""The build lock: one owner of the event log at a time.

`hsbuild.lock` is held with flock(2) by the owner (a run, a verify sweep, gc, `doctor --record` for a moment).
The kernel releases the flock when the owner dies, even by SIGKILL, so a lock file whose flock is free is stale
and safe to take over; its JSON record still names the dead owner, which `doctor` reports. A clean exit blanks the
record. What is guaranteed where (local vs network filesystems) is in docs/design.md, "The build lock".

- Inspecting (`status`, `sql`, `doctor`) never takes the lock: on Linux it reads /proc/locks, so a probe can
  never make an owner's acquire fail. Only where /proc/locks cannot tell (unreadable, or the owner found its
  own lock invisible there) does it fall back to a brief LOCK_SH probe; the owner's acquire retries for
  ACQUIRE_RETRY_S before it reports the build busy.
- The record is written into a preallocated RECORD_SIZE region (padded JSON), so taking or releasing the lock
  never needs a free block: it works on a full disk.
- A record naming another host that was never released is refused (flock on a network filesystem may be local
  to each host): the message names the host; `take_over=True` (`--take-over`) overrides.
- An owner that exits at once on a user's request (a second Ctrl-C: `os._exit`, no release) first calls
  `note_interrupted`: its record then says `interrupted`, so the next owner and `doctor` report an interrupted
  run, not a crash.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from builder.errors import BuildLockedError, BuildReadOnlyError, DiskFullError, ForeignLockError, is_no_space
from builder.layout import BuildLayout
from builder.log.holders import describe_pid

RECORD_SIZE = 4096  # bytes reserved for the lock record (JSON padded with spaces)
ACQUIRE_RETRY_S = 1.0  # an owner retries a busy flock this long before reporting "busy"
PROC_LOCKS = Path("/proc/locks")


def socket_path_for(lay: BuildLayout) -> Path:
    """The owner's query socket: deterministic, so clients find it even without the lock record."""
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


def hostname() -> str:
    return socket.gethostname()


@dataclass
class LockState:
    held: bool  # a live process holds the flock
    info: dict | None  # the lock file's record (owner of the live lock, or the dead one)
    missing: bool = False  # there is no lock file at all
    how: str = "proc_locks"  # how `held` was found: 'proc_locks' (no lock taken) or 'probe' (LOCK_SH)

    @property
    def stale(self) -> bool:
        return not self.held and bool(self.info)

    @property
    def foreign_host(self) -> str | None:
        """The host named by a record written on another machine, if any."""
        host = (self.info or {}).get("host")
        return host if host and host != hostname() else None


def parse_record(raw: bytes) -> dict | None:
    text = raw.replace(b"\0", b" ").strip()
    if not text:
        return None
    try:
        info = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def _dev_ino(st: os.stat_result) -> tuple[int, int, int]:
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def flock_holders(st: os.stat_result, text: str | None = None, kind: str = "WRITE") -> list[int] | None:
    """PIDs holding an exclusive flock (`kind` "READ": a shared one) on the file `st` describes, from /proc/locks
    (no lock is taken). None when /proc/locks cannot be read. Waiters (`->` lines) do not count."""
    if text is None:
        try:
            text = PROC_LOCKS.read_text()
        except OSError:
            return None
    want = _dev_ino(st)
    out = []
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 3704 fe:00:2146501 0 EOF"; a blocked waiter reads "1: -> FLOCK ..."
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != kind:
            continue
        try:
            major, minor, ino = parts[5].split(":")
            key = (int(major, 16), int(minor, 16), int(ino))
        except ValueError:
            continue
        if key == want:
            try:
                out.append(int(parts[4]))
            except ValueError:
                out.append(-1)
    return out


def flock_held(fd: int) -> bool:
    """Held? by taking LOCK_SH for an instant (the fallback: it can make a concurrent LOCK_EX|LOCK_NB fail,
    which the owner's retry absorbs)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def inspect_lock(lay: BuildLayout) -> LockState:
    """Who owns the build, without ever getting in an owner's way."""
    try:
        fd = os.open(lay.lock, os.O_RDONLY)
    except FileNotFoundError:
        return LockState(False, None, missing=True)
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, 65536, 0)
        info = parse_record(raw)
        holders = flock_holders(st)
        if holders is None or (not holders and info and not info.get("proc_locks")):
            # /proc/locks cannot tell, or the recorded owner could not see its own lock there
            return LockState(flock_held(fd), info, how="probe")
        return LockState(bool(holders), info)
    finally:
        os.close(fd)


class BuildLock:
    """Exclusive ownership of a build. Use as a context manager."""

    def __init__(self, lay: BuildLayout, purpose: str, run_id: str | None = None, take_over: bool = False):
        self.lay, self.purpose, self.run_id, self.take_over = lay, purpose, run_id, take_over
        self.fd: int | None = None
        self.previous: dict | None = None  # record left by an owner that did not release (dead, or elsewhere)
        self.socket_path = socket_path_for(lay)
        self.record_written = False  # False when the disk was too full to write the record (the lock holds)
        self.shared = False  # held by `acquire_shared`: a reader, no record

    def acquire(self) -> BuildLock:
        try:
            fd = os.open(self.lay.lock, os.O_RDWR | os.O_CREAT, 0o644)
            if not os.access(self.lay.root, os.W_OK | os.X_OK):  # the lock file may be writable, its dir not
                os.close(fd)
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.lay.root))
        except OSError as e:
            if is_no_space(e):
                raise DiskFullError(f"{self.lay.lock}: cannot create the lock file: the volume is full; "
                                    "free space and try again") from None
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise BuildReadOnlyError(
                    f"{self.lay.root}: not writable ({e.strerror}), so `{self.purpose}` cannot own it; remount the "
                    "volume read-write or fix its permissions (`hsbuild status`/`sql`/`doctor` still read it)"
                ) from None
            raise
        self._flock(fd, fcntl.LOCK_EX)
        try:
            self.previous = parse_record(os.pread(fd, 65536, 0))
            self._refuse_foreign(self.previous)
            # an exclusive flock on this inode in /proc/locks right now can only be ours: inspectors may
            # trust /proc/locks for this file (else they fall back to the LOCK_SH probe)
            visible = bool(flock_holders(os.fstat(fd)))
            info = {"pid": os.getpid(), "host": hostname(), "purpose": self.purpose, "run_id": self.run_id,
                    "started_at": time.time(), "socket": str(self.socket_path), "proc_locks": visible}
            self.record_written = write_record(fd, info)
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        self.fd = fd
        return self

    def acquire_shared(self) -> BuildLock:
        """Hold the build as a reader that must not see it change (an export of a build on a read-only mount):
        flock LOCK_SH on the lock file opened read-only, so nothing is written and a read-only mount works; no
        owner (LOCK_EX) can start meanwhile, and a live one makes this busy. A record of an owner on another host
        that never released it is refused as by `acquire`. No lock file (a copy of a build): nothing to hold."""
        try:
            fd = os.open(self.lay.lock, os.O_RDONLY)
        except FileNotFoundError:
            return self
        self._flock(fd, fcntl.LOCK_SH)
        try:
            self._refuse_foreign(parse_record(os.pread(fd, 65536, 0)))
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.shared = fd, True
        return self

    def _flock(self, fd: int, op: int) -> None:
        """flock `op` on `fd`, retried for ACQUIRE_RETRY_S; busy (fd closed) if it is still held then."""
        deadline = time.monotonic() + ACQUIRE_RETRY_S
        while True:
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise self._busy() from None
                time.sleep(0.01)

    def _busy(self) -> BuildLockedError:
        st = inspect_lock(self.lay)
        who = st.info or {}
        if not who.get("pid"):
            readers = self._shared_holders()
            if readers:  # no owner: a process that only reads the build holds it shared (export_readonly.py)
                return BuildLockedError(
                    f"{self.lay.root}: busy: {', '.join(describe_pid(p) for p in readers)} reads this build "
                    "under a shared lock (an export of a build it cannot write); wait for it to finish")
        where = f" on host {st.foreign_host}" if st.foreign_host else ""
        return BuildLockedError(
            f"{self.lay.root}: busy: {who.get('purpose', 'another process')} (pid {who.get('pid', '?')}{where}) "
            "owns this build; watch it with `hsbuild status`, or wait for it to finish")

    def _shared_holders(self) -> list[int]:
        try:
            return flock_holders(os.stat(self.lay.lock), kind="READ") or []
        except OSError:
            return []

    def _refuse_foreign(self, prev: dict | None) -> None:
        """A record from another host that was never released: that owner may still be running there (flock on
        a network filesystem may be local to each host). Refuse unless told to take over."""
        host = (prev or {}).get("host")
        if not prev or not host or host == hostname() or self.take_over:
            return
        when = prev.get("started_at")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, int | float) else "?"
        raise ForeignLockError(
            f"{self.lay.root}: the lock record names a {prev.get('purpose', 'run')} on host {host} (pid "
            f"{prev.get('pid', '?')}, started {since}) that never released the build; a lock taken on another "
            f"host may be invisible here. Make sure it is not running on {host}, then pass --take-over "
            f"(or remove {self.lay.lock})")

    def release(self, keep_previous: bool = False) -> None:
        """Release; `keep_previous` puts a dead owner's record back (for a short look by `doctor`, so the next
        run still reports whom it took over from)."""
        if self.fd is None:
            return
        try:
            if not self.shared:  # (a reader wrote no record)
                write_record(self.fd, self.previous if keep_previous else None)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BuildLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def note_interrupted(lay: BuildLayout, signum: int = signal.SIGINT) -> bool:
    """Mark this process's lock record as interrupted on purpose (e.g. a second Ctrl-C, just before os._exit): the
    lock stays held until the process exits, and the record it leaves says `interrupted` (signal name and time)
    instead of looking like a crash. Safe in a signal handler (plain pread/pwrite on the preallocated region, no
    buffered stream); never raises. Returns whether the record was marked (False when this process does not own
    the record or the file cannot be written)."""
    try:
        fd = os.open(lay.lock, os.O_RDWR)
    except OSError:
        return False
    try:
        info = parse_record(os.pread(fd, 65536, 0))
        if not info or info.get("pid") != os.getpid():
            return False
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        info["interrupted"] = {"signal": name, "at": time.time()}
        return write_record(fd, info)
    except OSError:
        return False
    finally:
        os.close(fd)


def write_record(fd: int, info: dict | None) -> bool:
    """Write the record (None: blank = released cleanly) into the file's preallocated region, so no new block
    is needed. Returns False when the disk was too full to write it (the flock still holds)."""
    data = json.dumps(info).encode() if info else b""
    try:
        if os.fstat(fd).st_size < RECORD_SIZE:
            os.posix_fallocate(fd, 0, RECORD_SIZE)
        if len(data) < RECORD_SIZE:
            data = data + b" " * (RECORD_SIZE - 1 - len(data)) + b"\n"
        os.pwrite(fd, data, 0)
        if len(data) > RECORD_SIZE:
            os.ftruncate(fd, len(data))
        return True
    except OSError as e:
        if not is_no_space(e) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    try:  # no room for the padded region (or no fallocate here): a bare record, or none
        os.ftruncate(fd, 0)
        if data.strip():
            os.pwrite(fd, data.rstrip(), 0)
        return True
    except OSError as e:
        if not is_no_space(e):
            raise
        return False
