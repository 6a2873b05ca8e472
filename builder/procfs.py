"""What /proc says about a process: its command line, its parent and ancestors, and which processes listen on a
TCP port. The readers every layer shares (doctor's process descriptions, an engine's identity check of the local
server it talks to); each never raises for a process that is gone or invisible (another PID namespace). And the CPUs this
process may use (its affinity mask and its cgroup's CPU quota)."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def cmdline(pid: int) -> list[str] | None:
    raw = read(PROC / str(pid) / "cmdline")
    if not raw:
        return None
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]


def parent_pid(pid: int) -> int | None:
    raw = read(PROC / str(pid) / "stat")
    if not raw:
        return None
    # pid (comm) state ppid ...; comm may hold spaces and parentheses, so split after the last ')'
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """Parent, grandparent, ... up to init (or as far as /proc shows)."""
    out: list[int] = []
    cur: int | None = pid
    while len(out) < limit:
        cur = parent_pid(cur) if cur is not None else None
        if not cur or cur in out:
            break
        out.append(cur)
    return out


def cwd(pid: int) -> str | None:
    """A process's working directory; None when it cannot be read."""
    try:
        return os.readlink(PROC / str(pid) / "cwd")
    except OSError:
        return None


def listening_sockets(port: int | None = None) -> set[str]:
    """'socket:[INODE]' of the listening TCP sockets (on `port`, or any) in /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        raw = read(PROC / "net" / name)
        for line in (raw or b"").decode(errors="replace").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and (port is None or int(parts[1].rsplit(":", 1)[1], 16) == port):
                inodes.add(f"socket:[{parts[9]}]")
    return inodes


def holds_any(pid: int, links: set[str]) -> bool | None:
    """Whether one of pid's open files is one of `links` (readlink of /proc/PID/fd/N); None when its open files
    cannot be read (another user's process: not ours to judge), False when it is gone."""
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except FileNotFoundError:
        return False
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(fd) in links:
                return True
        except OSError:
            continue
    return False


def listening_pids(port: int) -> set[int]:
    """The processes holding a listening TCP socket on `port` (from /proc/net/tcp{,6} and /proc/PID/fd)."""
    wanted = listening_sockets(port)
    if not wanted:
        return set()
    return {int(d.name) for d in PROC.iterdir() if d.name.isdigit() and holds_any(int(d.name), wanted)}


CGROUP = Path("/sys/fs/cgroup")  # cgroup v2's mount: this process's limits where it runs in a container


def quota_cpus(cgroup: Path = CGROUP) -> int | None:
    """CPUs a cgroup v2 CPU quota allows (`cpu.max`: "200000 100000" is 2, rounded up), or None where there is
    no quota ("max") or no such file. A container often sees every core of its host and is throttled to a few."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, -(-int(quota) // int(period)))


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may use: its affinity mask, lowered to its cgroup's CPU quota where that is smaller."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = max(1, os.cpu_count() or 1)
    quota = quota_cpus(cgroup)
    return min(cpus, quota) if quota is not None else cpus
