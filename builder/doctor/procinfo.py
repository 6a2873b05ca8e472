"""Who is a process: command line, name, systemd unit (from /proc/PID/cgroup), and is it one of ours.

Everything reads /proc and never raises for a process that is gone or invisible (another PID namespace,
e.g. a GPU process NVML reports with a host PID inside a container). `read_cgroup_text` is the boundary
tests substitute with a cgroup fixture.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")

# Units that are not a service someone started on purpose: stopping them would end a login or the user manager.
_NOT_A_SERVICE_PREFIXES = ("user@", "user-runtime-dir@", "session-", "init.scope", "systemd-")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def exists(pid: int) -> bool:
    return (PROC / str(pid)).is_dir()


def cmdline(pid: int) -> list[str] | None:
    raw = _read(PROC / str(pid) / "cmdline")
    if not raw:
        return None
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]


def process_name(pid: int) -> str | None:
    raw = _read(PROC / str(pid) / "comm")
    return raw.decode(errors="replace").strip() if raw else None


def parent_pid(pid: int) -> int | None:
    raw = _read(PROC / str(pid) / "stat")
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


def is_ours(pid: int, own_pids: Iterable[int]) -> bool:
    """True when pid is in own_pids or descends from one of them (a worker of our run)."""
    own = set(own_pids)
    return pid in own or any(a in own for a in ancestors(pid))


def read_cgroup_text(pid: int) -> str | None:
    raw = _read(PROC / str(pid) / "cgroup")
    return raw.decode(errors="replace") if raw is not None else None


@dataclass(frozen=True)
class SystemdUnit:
    name: str
    user: bool = False  # a `systemctl --user` unit

    def stop_command(self) -> str:
        ctl = "systemctl --user" if self.user else "systemctl"
        return f"{ctl} stop {self.name} && {ctl} disable {self.name}"


def systemd_unit_from_cgroup(text: str) -> SystemdUnit | None:
    """The innermost service in a /proc/PID/cgroup text (cgroup v2 `0::` line or the v1 name=systemd line)."""
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[0] == "0" and parts[1] == "" or parts[1] == "name=systemd"):
            paths.append(parts[2])
    for path in paths:
        comps = [c for c in path.split("/") if c]
        user = any(c.startswith("user@") and c.endswith(".service") for c in comps)
        for comp in reversed(comps):
            if comp.endswith(".service") and not comp.startswith(_NOT_A_SERVICE_PREFIXES):
                return SystemdUnit(comp, user=user)
    return None


@dataclass
class ProcInfo:
    pid: int
    visible: bool  # /proc/PID exists in our PID namespace
    name: str | None
    cmdline: list[str] | None
    unit: SystemdUnit | None
    ours: bool

    @property
    def command(self) -> str | None:
        return shlex.join(self.cmdline) if self.cmdline else None

    def stop_command(self) -> str:
        return self.unit.stop_command() if self.unit else f"kill {self.pid}"

    def as_dict(self) -> dict:
        return {"pid": self.pid, "visible": self.visible, "name": self.name, "cmdline": self.command,
                "unit": self.unit.name if self.unit else None, "user_unit": bool(self.unit and self.unit.user),
                "ours": self.ours, "stop": None if self.ours else self.stop_command()}


def describe(pid: int, own_pids: Iterable[int] = (), cgroup_reader: Callable[[int], str | None] | None = None,
             name: str | None = None) -> ProcInfo:
    reader = cgroup_reader or read_cgroup_text
    text = reader(pid)
    unit = systemd_unit_from_cgroup(text) if text else None
    return ProcInfo(pid=pid, visible=exists(pid), name=name or process_name(pid), cmdline=cmdline(pid), unit=unit,
                    ours=is_ours(pid, own_pids))


def listening_pids(port: int) -> set[int]:
    """The processes holding a listening TCP socket on `port` (from /proc/net/tcp{,6} and /proc/PID/fd)."""
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        raw = _read(PROC / "net" / name)
        for line in (raw or b"").decode(errors="replace").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                try:
                    if os.readlink(fd) in wanted:
                        pids.add(int(d.name))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids
