"""`env.engine_orphans`: vLLM/SGLang engine processes left behind by their server (docs/doctor.md).

The processes are real: a stand-in API server is a Python script named `vllm` started as `python .../vllm serve
MODEL` (the command line of vLLM's console script), its engine a `sleep` whose argv[0] is the engine's title
(`exec -a VLLM::EngineCore`, as setproctitle leaves it in /proc/PID/cmdline). The server is killed with SIGKILL as
in the incident, so the engine is reparented by the kernel (to PID 1, or to the nearest subreaper), and the fix
doctor prints is run through bash. Every process started here is killed (its process group, SIGKILL) at the end.

There is no GPU on this machine or in CI: where the rule needs GPU memory, NVML is faked at its one boundary
(tests/doctor/fake_nvml.py) and reports the real orphan's pid; the rules for hung servers and subreapers are also
played on a synthetic process table (`procs=`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNVML, GiB, unit_cgroup

from builder.config import load_config
from builder.doctor import checks as doctor_checks
from builder.doctor import engine as doctor_engine
from builder.doctor import gpu, procinfo
from builder.doctor.checks import Context
from builder.doctor.report import preflight_for_run, run_doctor
from builder.errors import PreflightError
from builder.layout import layout
from builder.log.events import EventLog

TITLE = "VLLM::EngineCore"
ENGINE = f"exec -a {TITLE} sleep 300"  # an engine process as /proc shows it: cmdline ['VLLM::EngineCore', '300']
# a stand-in API server: starts its engine as its child (in its process group, as multiprocessing does), says
# the engine's pid, and waits
SERVER = f"""import subprocess, sys, time
engine = subprocess.Popen(["bash", "-c", {ENGINE!r}])
print(engine.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def procs(tmp_path):
    """Start real processes, each in a new session (its own process group); all groups SIGKILLed at the end."""
    groups: list[subprocess.Popen] = []
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(SERVER)

    class Procs:
        @staticmethod
        def start(argv: list[str]) -> subprocess.Popen:
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                 start_new_session=True)
            groups.append(p)
            return p

        @staticmethod
        def server() -> tuple[subprocess.Popen, int]:
            """(the stand-in `vllm serve` server, its engine's pid once it carries the engine's title)."""
            p = Procs.start([sys.executable, str(script), "serve", "fake-model"])
            engine = int(p.stdout.readline())
            return p, wait_titled(engine)

    yield Procs
    for p in groups:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


def wait_titled(pid: int, title: str = TITLE, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = procinfo.read_proc(pid)
        if p is not None and p.cmdline and p.cmdline[0] == title:
            return pid
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never took the title {title}")


def gone(pid: int, timeout: float = 10.0) -> bool:
    """The process ended (no longer in /proc, or a zombie waiting for its new parent to reap it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = procinfo.read_proc(pid)
        if p is None or not p.alive:
            return True
        time.sleep(0.02)
    return False


def kill9(server: subprocess.Popen) -> None:
    """`kill -9` of the API server, as in the incident: its engine stays, reparented."""
    server.kill()
    server.wait(timeout=10)


def orphans_check(doc: dict) -> dict:
    return next(c for c in doc["checks"] if c["name"] == "env.engine_orphans")


def named(check: dict) -> dict[int, dict]:
    return {p["pid"]: p for p in check["data"]["processes"]}


# ---------------------------------------------------------------------------------------------------
# Real processes, the real CLI
# ---------------------------------------------------------------------------------------------------


def test_doctor_names_the_engine_of_a_killed_server_and_its_fix_ends_it(make_build, cli, procs):
    build = make_build(n=3)
    dead, orphan = procs.server()
    live, served = procs.server()  # a server that runs: its engine is not named
    # a zombie engine process (its parent, a `sleep`, never reaps it) in a process group of its own: alive, it
    # would be named by the rule (see the unit test below); as a zombie it holds nothing and is never named
    holder = procs.start(["bash", "-c", f"{sys.executable} -c \"import os, time; os.setpgrp(); "
                          "open('/proc/self/comm', 'w').write('VLLM::EngineCore'); print(os.getpid(), flush=True); "
                          "time.sleep(0.3)\" & exec sleep 300"])
    zombie = int(holder.stdout.readline())
    deadline = time.monotonic() + 10
    while (z := procinfo.read_proc(zombie)) is None or z.alive:
        assert time.monotonic() < deadline, "the zombie did not appear"
        time.sleep(0.02)
    assert procinfo.engine_title(z) == ("vllm", "VLLM::EngineCor")  # comm keeps 15 bytes of the title

    cp = cli("doctor", build, "--json", "--no-probe", "--no-record")
    assert cp.returncode == 0, cp.stderr
    before = named(orphans_check(json.loads(cp.stdout)))
    assert orphan not in before and served not in before and zombie not in before  # nothing killed yet

    kill9(dead)
    assert procinfo.read_proc(orphan).ppid != dead  # reparented: to PID 1 or to a subreaper
    cp = cli("doctor", build, "--json", "--no-probe", "--no-record")
    assert cp.returncode == 0, cp.stderr  # a warning: no GPU memory here
    check = orphans_check(json.loads(cp.stdout))
    found = named(check)
    assert check["status"] == "warn" and orphan in found, check
    assert served not in found and zombie not in found and live.pid not in found and holder.pid not in found
    rec = found[orphan]
    assert rec["title"] == TITLE and rec["reason"] == "orphan" and rec["family"] == "vllm"
    assert rec["ppid"] == procinfo.read_proc(orphan).ppid and rec["rss_bytes"] > 0
    assert f"pid {orphan} {TITLE}" in check["summary"] and "without its server" in check["summary"]
    assert any(line.startswith(f"pid {orphan} {TITLE}: parent pid {rec['ppid']}") for line in check["details"])
    # the dead server's group holds nothing else: the whole group goes
    assert rec["kill"] == f"kill -s KILL -- -{dead.pid}" and rec["kill"] in check["fix"].split("; ")

    text = cli("doctor", build, "--no-probe", "--no-record").stdout
    assert "WARN  env.engine_orphans" in text and f"fix: {check['fix']}" in text

    # the printed command, run as a user would (only this orphan's: others on the machine are not ours to end)
    subprocess.run(["bash", "-c", rec["kill"]], check=True)
    assert gone(orphan), f"pid {orphan} survived {rec['kill']!r}"
    assert procinfo.read_proc(served).alive and live.poll() is None  # the live server and its engine stay
    cp = cli("doctor", build, "--json", "--no-probe", "--no-record")
    assert orphan not in named(orphans_check(json.loads(cp.stdout)))


def test_own_engines_and_an_offline_engine_under_its_program_are_not_named(make_build, procs):
    """An engine process below this process (own_pids: a run's launched server) is never named, nor an engine
    run by the program that started it (an offline `vllm.LLM(...)` script: a Python program in its group)."""
    mine = procs.start(["bash", "-c", ENGINE])  # a child of this test process, in a group of its own
    wait_titled(mine.pid)
    offline = procs.start([sys.executable, "-c", f"import subprocess, sys, time\n"
                           f"e = subprocess.Popen(['bash', '-c', {ENGINE!r}])\nprint(e.pid, flush=True)\n"
                           "time.sleep(300)"])
    engine = wait_titled(int(offline.stdout.readline()))

    pids = {o.pid for o in procinfo.engine_orphans(())}
    assert mine.pid in pids and engine not in pids  # without own_pids the rule names the test's child
    assert mine.pid not in {o.pid for o in procinfo.engine_orphans({os.getpid()})}

    report = run_doctor(layout(make_build(n=3)), probe=False, record=False)  # own_pids: this process
    found = {p["pid"] for p in next(c for c in report.checks if c.name == "env.engine_orphans").data["processes"]}
    assert mine.pid not in found and engine not in found


def test_an_orphan_holding_gpu_memory_blocks_a_gpu_build(make_build, procs, monkeypatch):
    """No GPU here: NVML is faked and lists the real orphan as holding 70 GiB of GPU 0. A build that computes on
    that GPU (in-process on cuda, or an engine build, whose server needs every GPU here) is refused at preflight
    with the kill command; a CPU build is only warned."""
    dead, orphan = procs.server()
    kill9(dead)
    nvml = FakeNVML([FakeGpu(used=71 * GiB, procs=[(orphan, 70 * GiB, "VLLM::EngineCore")]), FakeGpu()])
    monkeypatch.setattr(gpu, "_nvml", lambda: nvml)
    monkeypatch.setattr(doctor_checks, "cuda_probe", lambda: (True, 2, "torch 2.5.1 (CUDA 12.4)"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    lay = layout(make_build(n=3, name="gpu", device="cuda"))
    check = next(c for c in run_doctor(lay, probe=False, record=False).checks if c.name == "env.engine_orphans")
    rec = next(p for p in check.data["processes"] if p["pid"] == orphan)
    assert check.status == "fail" and check.data["blocking_gpus"] == [0], check
    assert rec["gpu_bytes"] == 70 * GiB and rec["gpus"] == [0] and "GPU 70.0 GiB on GPU 0" in check.summary
    with EventLog(lay.events) as log, pytest.raises(PreflightError) as ei:
        preflight_for_run(lay, load_config(lay), log, force=False, own_pids={os.getpid()}, probe=False)
    assert "env.engine_orphans" in str(ei.value) and f"kill -s KILL -- -{dead.pid}" in str(ei.value)

    # the build computes on GPU 1 only: GPU 0's orphan does not block it
    lay1 = layout(make_build(n=3, name="gpu1", device="cuda:1"))
    check = next(c for c in run_doctor(lay1, probe=False, record=False).checks if c.name == "env.engine_orphans")
    assert check.status == "warn" and check.data["blocking_gpus"] == []

    cpu = layout(make_build(n=3, name="cpu", device="cpu"))
    check = next(c for c in run_doctor(cpu, probe=False, record=False).checks if c.name == "env.engine_orphans")
    assert check.status == "warn" and orphan in {p["pid"] for p in check.data["processes"]}

    # an engine build's GPUs are its server's: every visible one (the preflight's device is "cpu")
    cfg = dataclasses.replace(load_config(cpu), backend="vllm")
    ctx = Context(cpu, cfg, "cpu", {os.getpid()}, for_run=True)
    assert doctor_engine.check_engine_orphans(ctx).status == "fail"


# ---------------------------------------------------------------------------------------------------
# The rules on a synthetic process table
# ---------------------------------------------------------------------------------------------------

BASE = 2**22 + 1000  # above any pid_max: no real process answers for these in /proc


def table(*rows: tuple) -> dict[int, procinfo.Proc]:
    """rows of (pid, ppid, pgid, command line[, state])."""
    out = {}
    for pid, ppid, pgid, cmd, *state in rows:
        argv = tuple(cmd.split())
        out[pid] = procinfo.Proc(pid, ppid, pgid, state[0] if state else "S", 100 << 20, argv[0][:15], argv)
    return out


def session_cgroups(units: dict[int, str] | None = None):
    units = units or {}
    return lambda pid: unit_cgroup(units[pid]) if pid in units else "0::/user.slice/user-1000.slice/session-3.scope\n"


def test_orphans_under_init_or_a_subreaper_and_what_ends_them():
    s, dead = BASE, BASE + 99  # a `systemd --user` subreaper; the killed server's pid (its group's id)
    procs = table(
        (1, 0, 1, "/sbin/init"),
        (s, 1, s, "/usr/lib/systemd/systemd --user"),
        (BASE + 1, s, dead, "VLLM::EngineCore"),  # reparented to the subreaper, with its Worker below it
        (BASE + 2, BASE + 1, dead, "VLLM::Worker_TP0"),
        (BASE + 3, 1, BASE + 30, "sglang::scheduler_TP0"),  # an SGLang one under init ...
        (BASE + 30, 1, BASE + 30, "tail -f sglang.log"),  # ... whose group holds something else: pids, not -PGID
        (BASE + 4, s, BASE + 4, "VLLM::EngineCore", "Z"),  # a zombie
        (BASE + 5, BASE + 50, BASE + 50, "VLLM::EngineCore"),  # run by an offline script: not an orphan
        (BASE + 50, 1, BASE + 50, "/usr/bin/python3 offline_batch.py"),
        (BASE + 6, BASE + 60, BASE + 60, "VLLM::EngineCore"),  # adopted by a shell as a container's PID 1
        (BASE + 60, 0, BASE + 60, "/bin/bash -c vllm serve m; sleep infinity"),
        (BASE + 7, BASE + 70, BASE + 7, "VLLM::EngineCore"),  # under one of our pids (a run's server)
        (BASE + 70, 1, BASE + 70, "/usr/bin/python3 -m builder.cli run b --launch"),
    )
    found = {o.pid: o for o in procinfo.engine_orphans({BASE + 70}, procs=procs, cgroup_reader=session_cgroups())}
    assert sorted(found) == [BASE + 1, BASE + 2, BASE + 3, BASE + 6]
    assert all(o.reason == "orphan" for o in found.values())
    assert found[BASE + 1].ppid == s and found[BASE + 1].parent == "/usr/lib/systemd/systemd --user"
    assert found[BASE + 2].title == "VLLM::Worker_TP0" and found[BASE + 3].family == "sglang"
    assert found[BASE + 1].kill == found[BASE + 2].kill == f"kill -s KILL -- -{dead}"
    # the scheduler's group holds a live `tail`, the shell's group the shell: only the pids go
    assert found[BASE + 3].kill == found[BASE + 6].kill == f"kill -9 {BASE + 3} {BASE + 6}"

    # in a unit whose every live process is to go: the unit is stopped; a unit that runs anything else is not
    units = {BASE + 1: "vllm-old.service", BASE + 2: "vllm-old.service"}
    found = {o.pid: o for o in procinfo.engine_orphans(procs=procs, cgroup_reader=session_cgroups(units))}
    assert found[BASE + 1].kill == "systemctl stop vllm-old.service" and found[BASE + 1].unit.name == "vllm-old.service"
    units[BASE + 30] = "vllm-old.service"
    found = {o.pid: o for o in procinfo.engine_orphans(procs=procs, cgroup_reader=session_cgroups(units))}
    assert found[BASE + 1].kill == f"kill -s KILL -- -{dead}"


def test_an_engine_holding_gpu_memory_under_a_server_that_listens_nowhere():
    """NVML is faked (a mapping pid -> (bytes, GPUs), as the check builds it from NVML): this machine has no GPU."""
    srv = BASE + 200
    server = "/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model /m --port 8000"
    rows = [(srv, 1, srv, server), (srv + 1, srv, srv, "VLLM::EngineCore"), (srv + 2, srv + 1, srv, "VLLM::Worker_TP0")]
    gpus = {srv + 2: (70 * GiB, [0])}

    found = procinfo.engine_orphans(procs=table(*rows), gpu_memory=gpus, cgroup_reader=session_cgroups())
    assert [(o.pid, o.reason, o.server_pid, o.gpu_bytes, o.gpus) for o in found] == [
        (srv + 2, "no_listener", srv, 70 * GiB, [0])]  # the EngineCore holds no GPU memory: only its Worker
    assert found[0].kill == f"kill -s KILL -- -{srv}"  # the server goes with everything below it
    assert procinfo.engine_orphans(procs=table(*rows), cgroup_reader=session_cgroups()) == []  # no NVML: no rule

    more = table(*rows, (srv + 3, srv, srv, "tail -f server.log"))  # below the server: goes with it
    (o,) = procinfo.engine_orphans(procs=more, gpu_memory=gpus, cgroup_reader=session_cgroups())
    assert o.kill == f"kill -s KILL -- -{srv}"
    more = table(*rows, (srv + 4, 1, srv, "tail -f server.log"))  # in the server's group, not below it: stays
    (o,) = procinfo.engine_orphans(procs=more, gpu_memory=gpus, cgroup_reader=session_cgroups())
    assert o.kill == f"kill -9 {srv} {srv + 1} {srv + 2}"

    headless = table((srv, 1, srv, server + " --headless"), *rows[1:])  # an engine-only node: listens nowhere
    assert procinfo.engine_orphans(procs=headless, gpu_memory=gpus, cgroup_reader=session_cgroups()) == []

    # a server that listens (this process stands in for it: it holds a real listening socket) is left alone
    me = os.getpid()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        listening = table((me, 1, me, server), (srv + 1, me, me, "VLLM::EngineCore"),
                          (srv + 2, srv + 1, me, "VLLM::Worker_TP0"))
        assert procinfo.engine_orphans(procs=listening, gpu_memory=gpus, cgroup_reader=session_cgroups()) == []


def test_engine_titles_and_servers():
    def proc(cmd: str, comm: str = "python3") -> procinfo.Proc:
        return procinfo.Proc(BASE, 1, BASE, "S", 0, comm, tuple(cmd.split()) if cmd else None)

    assert procinfo.engine_title(proc("VLLM::EngineCore_DP0")) == ("vllm", "VLLM::EngineCore_DP0")
    assert procinfo.engine_title(proc("sglang::detokenizer")) == ("sglang", "sglang::detokenizer")
    assert procinfo.engine_title(proc("", comm="VLLM::Worker_TP")) == ("vllm", "VLLM::Worker_TP")  # comm only
    assert procinfo.engine_title(proc("VLLM::APIServer_0")) is None  # a server, not an engine
    assert procinfo.engine_title(proc("ray::RayWorkerWrapper")) is None
    assert procinfo.engine_title(proc("/usr/bin/python3 -m vllm.entrypoints.openai.api_server")) is None
    assert procinfo.front_end_family(proc("/usr/bin/python3 /venv/bin/vllm serve /m")) == "vllm"
    assert procinfo.front_end_family(proc("python3 -m sglang.launch_server --model-path /m")) == "sglang"
    assert procinfo.front_end_family(proc("VLLM::APIServer_DP0")) == "vllm"
    assert procinfo.front_end_family(proc("/usr/bin/python3 train.py")) is None
    assert Path("/proc/self").exists()
