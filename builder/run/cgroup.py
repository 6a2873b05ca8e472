"""A launched server's own cgroup (v2), where the machine allows it: every process the server starts stays in it,
also one that leaves the server's process group (`setsid`), so one write to `cgroup.kill` ends all of them.

Made under this process's own cgroup v2 directory (`/proc/self/cgroup`'s `0::` line, under the cgroup2 mount);
where there is no cgroup2 mount or it is not writable (no delegation, a read-only /sys/fs/cgroup), `create`
returns None and the process group alone contains the server (builder/run/server_lifecycle.py). The child enters the
cgroup between fork and exec (`enter`), before it can start anything.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def cgroup2_root() -> Path | None:
    """This process's cgroup v2 directory, or None (no unified hierarchy mounted, or not in one)."""
    try:
        mounts = (PROC / "self" / "mountinfo").read_text().splitlines()
        own = next((ln.split(":", 2)[2] for ln in (PROC / "self" / "cgroup").read_text().splitlines()
                    if ln.startswith("0::")), None)
    except OSError:
        return None
    if own is None:
        return None
    for ln in mounts:
        left, _, right = ln.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) > 4:
            root, mnt = fields[3], fields[4]  # the mount's root inside the hierarchy, and where it is mounted
            rel = os.path.relpath(own, root) if own.startswith(root) else None
            if rel is not None:
                return Path(mnt) / ("" if rel == "." else rel)
    return None


@dataclass(frozen=True)
class ServerCgroup:
    path: Path

    @classmethod
    def create(cls, name: str) -> ServerCgroup | None:
        """A new, empty cgroup `name` under this process's own; None where that cannot be made."""
        root = cgroup2_root()
        if root is None:
            return None
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            if not (path / "cgroup.procs").is_file():
                return None
        except OSError:
            return None
        return cls(path)

    def enter(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        """Move the calling process into the cgroup (before it starts anything); silently stays out if it cannot."""
        try:
            fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        except OSError:
            pass

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self, timeout: float = 30.0) -> bool:
        """SIGKILL every process in it (`cgroup.kill`, else one by one) and wait until it is empty; then remove
        it. Returns whether it is empty."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        empty = not self.pids()
        if empty:
            try:
                self.path.rmdir()
            except OSError:
                pass
        return empty


PREFIX = "hsbuild-server-"  # + the launching hsbuild's pid + "-" + its restart count
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-\d+")


def _alive(pid: int) -> bool:
    try:
        stat = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def reap_stale(timeout: float = 30.0) -> int:
    """Kill what is left in the server cgroups of hsbuild processes that are gone (a run killed with -9 cannot
    stop its server: the API server dies with it, PR_SET_PDEATHSIG, but its engine processes may not), and remove
    those cgroups. Returns how many processes it killed. Another live hsbuild's server is never touched."""
    root = cgroup2_root()
    if root is None:
        return 0
    killed = 0
    try:
        names = [d.name for d in root.iterdir() if d.is_dir()]
    except OSError:
        return 0
    for name in names:
        m = _NAME.fullmatch(name)
        if m and not _alive(int(m.group(1))):
            cg = ServerCgroup(root / name)
            killed += len(cg.pids())
            cg.kill(timeout)
    return killed
