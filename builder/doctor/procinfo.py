"""Who is a process: command line, name, systemd unit (from /proc/PID/cgroup), is it one of ours, and is it an
engine's process left without its server. (The plain /proc readers: builder/procfs.py.)

Everything reads /proc and never raises for a process that is gone or invisible (another PID namespace,
e.g. a GPU process NVML reports with a host PID inside a container). `read_cgroup_text` is the boundary
tests substitute with a cgroup fixture.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from builder.extract.backends import registry as backends
from builder.extract.backends.serving import EngineProcesses
from builder.procfs import PROC, ancestors, cmdline, holds_any, listening_sockets, read

# Units that are not a service someone started on purpose: stopping them would end a login or the user manager.
_NOT_A_SERVICE_PREFIXES = ("user@", "user-runtime-dir@", "session-", "init.scope", "systemd-")


def exists(pid: int) -> bool:
    return (PROC / str(pid)).is_dir()


def process_name(pid: int) -> str | None:
    raw = read(PROC / str(pid) / "comm")
    return raw.decode(errors="replace").strip() if raw else None


def is_ours(pid: int, own_pids: Iterable[int]) -> bool:
    """True when pid is in own_pids or descends from one of them (a worker of our run)."""
    own = set(own_pids)
    return pid in own or any(a in own for a in ancestors(pid))


def read_cgroup_text(pid: int) -> str | None:
    raw = read(PROC / str(pid) / "cgroup")
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


# ---------------------------------------------------------------------------------------------------
# Engine processes left behind by their server (`env.engine_orphans`, docs/doctor.md)
# ---------------------------------------------------------------------------------------------------

# Engines title their processes with setproctitle as PREFIX::NAME; with setproctitle the title is the whole
# /proc/PID/cmdline and, cut to 15 bytes, /proc/PID/comm. Each registered engine says how its processes look
# (`EngineProcesses`, builder/extract/backends/serving.py); the engines hsbuild has no backend for are named here:
# SGLang titles `sglang::scheduler`, `sglang::scheduler_TP0`, `sglang::detokenizer`, ..., and serves with
# `python -m sglang.launch_server` or `sglang serve`.
OTHER_ENGINES = (EngineProcesses(family="sglang", name="SGLang", title_prefixes=("sglang",), modules=("sglang",),
                                 scripts=("sglang",)),)
_TITLE = re.compile(r"([A-Za-z0-9_.-]+)::(\S+)")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def engine_families() -> list[EngineProcesses]:
    """The engines whose processes doctor recognizes: the registered ones' (builder/extract/backends/registry.py),
    then OTHER_ENGINES."""
    out: dict[str, EngineProcesses] = {}
    for f in [*backends.engine_processes(), *OTHER_ENGINES]:
        out.setdefault(f.family, f)
    return list(out.values())


def _titled(text: str) -> tuple[EngineProcesses, re.Match] | None:
    """The engine whose title PREFIX::NAME `text` carries, and the match."""
    m = _TITLE.match(text.strip())
    if m:
        for fam in engine_families():
            if m.group(1) in fam.prefixes():
                return fam, m
    return None


@dataclass(frozen=True)
class Proc:
    """One process as one pass over /proc saw it (its stat line and command line)."""
    pid: int
    ppid: int
    pgid: int
    state: str  # R, S, D, Z (zombie), ...
    rss_bytes: int
    comm: str
    cmdline: tuple[str, ...] | None

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X", "x")

    @property
    def command(self) -> str:
        return shlex.join(self.cmdline) if self.cmdline else f"[{self.comm}]"


def read_proc(pid: int) -> Proc | None:
    raw = read(PROC / str(pid) / "stat")
    if not raw:
        return None
    close = raw.rfind(b")")
    comm = raw[raw.find(b"(") + 1 : close].decode(errors="replace")
    rest = raw[close + 2 :].split()  # state ppid pgrp session tty tpgid flags minflt ... rss is the 22nd
    try:
        state, ppid, pgid, rss = rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[21])
    except (IndexError, ValueError):
        return None
    args = cmdline(pid)
    return Proc(pid, ppid, pgid, state, max(rss, 0) * _PAGE, comm, tuple(a.strip() for a in args) if args else None)


def scan_processes() -> dict[int, Proc]:
    """Every process /proc shows (one stat and one cmdline read each); never raises."""
    out: dict[int, Proc] = {}
    try:
        names = [d.name for d in PROC.iterdir() if d.name.isdigit()]
    except OSError:
        return out
    for name in names:
        p = read_proc(int(name))
        if p is not None:
            out[p.pid] = p
    return out


def engine_title(p: Proc) -> tuple[str, str] | None:
    """(family, title) of an engine process (an `engine core`, a worker, a scheduler, ...) by its process title;
    None for anything else, the API servers included."""
    for text in ((p.cmdline[0] if p.cmdline else ""), p.comm):
        found = _titled(text)
        if found is not None:
            fam, m = found
            if fam.server_titles and m.group(2).startswith(fam.server_titles):
                return None
            return fam.family, m.group(0)
    return None


def front_end_family(p: Proc) -> str | None:
    """The engine whose server (or other entry point) p runs: `python -m MODULE...` of one of the engines'
    modules, one of their console scripts (`python .../bin/SCRIPT serve`), a process titled as one of their servers
    (an extra API server); None for anything else."""
    argv = p.cmdline or ()
    titled = _titled(argv[0] if argv else p.comm)
    if titled is not None and titled[0].server_titles and titled[1].group(2).startswith(titled[0].server_titles):
        return titled[0].family
    families = engine_families()
    for i, a in enumerate(argv[:-1]):
        if a == "-m":
            fam = next((f for f in families if argv[i + 1].split(".", 1)[0] in f.modules), None)
            if fam is not None:
                return fam.family
    for a in argv[:2]:
        fam = next((f for f in families if os.path.basename(a) in f.scripts), None)
        if fam is not None:
            return fam.family
    return None


@dataclass
class EngineOrphan:
    """An engine process whose server is gone (reason 'orphan'), or that holds GPU memory under a server that
    does not listen (reason 'no_listener'), with the command that ends it and the rest of its group."""
    pid: int
    family: str  # its engine's (EngineProcesses.family)
    title: str  # its process title (PREFIX::NAME)
    reason: str  # 'orphan' | 'no_listener'
    ppid: int  # its parent now: init or a subreaper for an orphan
    parent: str | None  # the parent's command line
    pgid: int
    rss_bytes: int
    kill: str = ""  # the command that ends it (with its group, or its unit)
    server_pid: int | None = None  # no_listener: the server above it
    gpu_bytes: int | None = None  # GPU memory NVML lists for it; None where not asked or not listed
    gpus: list[int] = field(default_factory=list)  # NVML indices of the GPUs it holds memory on
    unit: SystemdUnit | None = None

    @property
    def engine(self) -> str:
        return next((f.name for f in engine_families() if f.family == self.family), self.family)

    def as_dict(self) -> dict:
        return {"pid": self.pid, "family": self.family, "title": self.title, "reason": self.reason,
                "ppid": self.ppid, "parent": self.parent, "pgid": self.pgid, "rss_bytes": self.rss_bytes,
                "gpu_bytes": self.gpu_bytes, "gpus": self.gpus, "server_pid": self.server_pid,
                "unit": self.unit.name if self.unit else None, "user_unit": bool(self.unit and self.unit.user),
                "kill": self.kill}


def _ancestry(pid: int, procs: dict[int, Proc]) -> list[int]:
    out: list[int] = []
    cur = procs[pid].ppid if pid in procs else 0
    while cur in procs and cur not in out and len(out) < 64:
        out.append(cur)
        cur = procs[cur].ppid
    return out


def _python(p: Proc) -> bool:
    """Whether p runs a Python interpreter (by its argv[0], name or executable): a program that may have started
    an engine itself (multiprocessing)."""
    names = [os.path.basename(p.cmdline[0]) if p.cmdline else "", p.comm]
    try:
        names.append(os.path.basename(os.readlink(PROC / str(p.pid) / "exe")))
    except OSError:
        pass
    return p.comm == "pt_main_thread" or any(n.startswith("python") for n in names)


def engine_orphans(own_pids: Iterable[int] = (), *, gpu_memory: Mapping[int, tuple[int | None, list[int]]] | None
                   = None, cgroup_reader: Callable[[int], str | None] | None = None,
                   procs: dict[int, Proc] | None = None) -> list[EngineOrphan]:
    """Engine processes (`engine_families`) left behind by their server, from one pass over /proc, sorted by pid.

    An engine process is an orphan when the process above its engine tree (the parent of its topmost engine
    process: a Worker hangs under its EngineCore) is not a server of the same engine (`front_end_family`) nor
    the program that started it. A killed server's engines are reparented to PID 1, or, in containers and under
    service managers, to the nearest subreaper (tini, a container shim, `systemd --user`, a job runner), so the
    rule is never "the parent is PID 1". The program that started an engine itself (an offline engine script, a
    trainer) is a Python program in the engine's process group (multiprocessing keeps the group); an
    adopting init or subreaper is in another group, or is no Python program (a shell as a container's PID 1).
    With `gpu_memory` (pid -> (bytes, [GPU indices]), as NVML lists them) an engine process that holds GPU memory
    under a live server that listens on no TCP port (hung, or still loading) is named too (reason
    'no_listener'), unless the server runs `--headless` or its open files cannot be read (another user's).
    Processes of `own_pids` or below them and zombies are never named. Never raises."""
    procs = scan_processes() if procs is None else procs
    reader = cgroup_reader or read_cgroup_text
    own = set(own_pids)
    titles = {pid: t for pid, p in procs.items() if p.alive and (t := engine_title(p))}
    fronts = {pid: f for pid, p in procs.items() if p.alive and (f := front_end_family(p))}
    listening: set[str] | None = None
    found: list[EngineOrphan] = []
    for pid in sorted(titles):
        if pid in own or own.intersection(_ancestry(pid, procs)):
            continue
        fam, title = titles[pid]
        top = pid
        while (up := procs[top].ppid) in titles and titles[up][0] == fam and up != pid:
            top = up
        owner = procs.get(procs[top].ppid)
        server = None
        if owner is None or not owner.alive or (fronts.get(owner.pid) != fam and (
                owner.pgid != procs[top].pgid or not _python(owner))):
            reason = "orphan"
        elif fronts.get(owner.pid) == fam and gpu_memory and (gpu_memory.get(pid) or (0, []))[0]:
            servers = [a for a in _ancestry(pid, procs) if fronts.get(a) == fam]
            if any("--headless" in (procs[a].cmdline or ()) for a in servers):
                continue  # the engine-only nodes of a multi-node server listen nowhere, on purpose
            if listening is None:
                listening = listening_sockets()
            extra = [q.pid for q in procs.values() if q.ppid in servers and fronts.get(q.pid) == fam]
            if any(holds_any(a, listening) is not False for a in servers + extra):
                continue  # it listens (or its open files cannot be read: not ours to judge)
            reason, server = "no_listener", servers[-1]
        else:
            continue  # under its server, or under the program that runs it
        text = reader(pid)
        gb, gpus = (gpu_memory or {}).get(pid, (None, []))
        found.append(EngineOrphan(pid, fam, title, reason, procs[pid].ppid, owner.command if owner else None,
                                  procs[pid].pgid, procs[pid].rss_bytes, server_pid=server, gpu_bytes=gb,
                                  gpus=sorted(set(gpus)), unit=systemd_unit_from_cgroup(text) if text else None))
    _kill_commands(found, procs, reader)
    return found


def _kill_commands(found: list[EngineOrphan], procs: dict[int, Proc], reader: Callable[[int], str | None]) -> None:
    """Set each one's `kill`: `systemctl stop UNIT` when every live process of its unit is to go (never the unit
    doctor itself runs in); else the whole process group (`kill -s KILL -- -PGID`, which /bin/sh's dash, bash
    and procps' kill all take, unlike `kill -9 -- -PGID`) when every live member of it is to go; else
    `kill -9 PID ...`. A server that does not listen goes with everything below it (killing the server alone
    would orphan its engines)."""
    if not found:
        return
    units: dict[int, SystemdUnit | None] = {}

    def unit_of(pid: int) -> SystemdUnit | None:
        if pid not in units:
            text = reader(pid)
            units[pid] = systemd_unit_from_cgroup(text) if text else None
        return units[pid]

    mine = unit_of(os.getpid())
    alive = [p for p in procs.values() if p.alive]
    goes: dict[int, set[int]] = {}  # what each finding takes down with it: itself, or its server and all below
    for o in found:
        goes[o.pid] = {o.pid}
        if o.reason == "no_listener" and o.server_pid is not None:
            goes[o.pid] |= {o.server_pid} | {p.pid for p in alive if o.server_pid in _ancestry(p.pid, procs)}
    doomed = set().union(*goes.values())
    leftover: dict[int | None, set[int]] = {}
    for o in found:
        if o.unit and o.unit != mine and all(p.pid in doomed for p in alive if unit_of(p.pid) == o.unit):
            o.kill = f"{'systemctl --user' if o.unit.user else 'systemctl'} stop {o.unit.name}"
        elif o.pgid > 1 and all(p.pid in doomed for p in alive if p.pgid == o.pgid):
            o.kill = f"kill -s KILL -- -{o.pgid}"
        else:
            leftover.setdefault(o.server_pid, set()).update(goes[o.pid])
    for server, pids in leftover.items():
        cmd = "kill -9 " + " ".join(map(str, sorted(pids)))
        for o in found:
            if not o.kill and o.server_pid == server:
                o.kill = cmd
