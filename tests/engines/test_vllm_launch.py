"""`hsbuild run --launch`: hsbuild starts the exact serve-command as its child, and when that server hangs
mid-run (SIGSTOP) or crashes (its API process killed with -9; across nodes: test_vllm_ray.py) the run pauses
(`server_unavailable`), in-flight samples go back to pending (not failed for good, not counted against
--max-attempts), the server is restarted, and the run finishes by itself. The staging folder is a small real
tmpfs: it never holds more than the in-flight window. (In connect mode the run waits for the server someone
else runs to come back: test_vllm_identity.py, on the server its module shares.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import forked
import pytest
from conftest import Hold, live_count, random_rows, set_config, write_jsonl
from test_vllm import _check_against_transformers, _one_written_each
from vllm_fixture import ENGINE_ARGS, VOCAB, free_port, hsbuild_cmd, needs_vllm

from builder.extract.backends.staging import staging_usage
from builder.layout import layout
from builder.log.events import EventLog
from builder.run.cgroup import ServerCgroup
from builder.run.create import init_build

pytestmark = [pytest.mark.slow, needs_vllm]


def _server_pids(port: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and str(port).encode() in cmd:
            pids.append(int(p.name))
    return pids


def _why(build: Path, out: str, err: str) -> str:
    """What a user would look at when the run did not end 0: its summary, its messages, the failures logged."""
    cp = forked.run(hsbuild_cmd("sql", build, "SELECT sample_id, attempt, reason, detail FROM events "
                                    "WHERE kind = 'failed' ORDER BY seq", "--csv"), capture_output=True, text=True)
    return f"stdout: {out[-2000:]}\nstderr: {err[-3000:]}\nfailed events: {cp.stdout[-3000:]}{cp.stderr[-500:]}"


def test_a_launched_server_that_hangs_then_crashes_is_restarted_each_time_and_the_run_finishes(tmp_path, tiny_llama,
                                                                                               tmpfs, hold):
    """One launched run, its server lost twice (one server start saved: they take most of this test's time):

    1. The server hangs (SIGSTOP: alive, silent): killed after HSBUILD_SERVER_HUNG, then restarted (restart 1).
    2. The restarted server's API process alone is killed with -9, as a crash would. That leaves vLLM's engine
       processes running, reparented (`VLLM::EngineCore`, its worker): the incident's rogue GPU holder. Before
       restart 2 every process of that server's group is killed (checked in /proc), and it runs in a cgroup of
       its own where this machine lets one be made.

    The run finishes by itself, every sample once, none failed for good; no server outlives it; the staging
    folder (a small real tmpfs) never holds more than the in-flight window. Deterministic: the worker is held by
    the test hook (builder/run/testhook.py) before its 6th task for the hang and again before its 14th for the
    crash, so each lands mid-run whatever the sample count."""
    n, inflight = 40, 4
    staging = tmpfs
    port = free_port()
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(n, 21, vocab=VOCAB, hi=300))
    build = init_build(tmp_path / "b", src, model=str(tiny_llama), backend="vllm", server=f"http://127.0.0.1:{port}",
                       staging=str(staging), inflight=inflight).root
    set_config(build, engine_args=list(ENGINE_ARGS))  # a short context for the tiny model

    peak = {"files": 0, "bytes": 0}
    done = threading.Event()

    def watch() -> None:  # the staging folder's high-water mark, sampled throughout the run
        while not done.is_set():
            files, size = staging_usage(staging)
            peak["files"], peak["bytes"] = max(peak["files"], files), max(peak["bytes"], size)
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    hang, crash = hold(6), hold(14)
    run = forked.Popen(hsbuild_cmd("run", build, "--no-progress", "--launch"), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True,
                       env={**Hold.together(hang, crash), "HSBUILD_SERVER_HUNG": "15"})
    old: list[tuple[int, str]] = []
    api = 0
    try:
        # 1. the hang
        hang.wait(1, run, timeout=900)  # (the launched server's start included)
        pids = _server_pids(port)
        assert pids, "no launched server found"
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP)
        hang.release()  # its 6th sample goes to the silent server

        # 2. the crash of the restarted server's API process, once the run has resumed on it: the held worker
        # can reach its 14th task while the run is still paused (its queued samples fail at once while the hung
        # server is replaced), and a crash then would fall into the same pause
        crash.wait(1, run, timeout=900)
        deadline = time.monotonic() + 600
        while _resumed(build) < 1 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _resumed(build) >= 1, "the run did not resume after the hung server's restart"
        [api] = _server_pids(port)
        assert api not in pids, "the hung server was not replaced"
        old = _group(api)
        assert any("VLLM::EngineCore" in c for _, c in old), f"no engine process in the server's group: {old}"
        can = ServerCgroup.create(f"hsbuild-probe-{os.getpid()}")
        if can is not None:  # where this machine lets a cgroup be made, the server runs in its own
            can.kill(1)
            cgroups = {Path(f"/proc/{pid}/cgroup").read_text().split("0::", 1)[1].split()[0] for pid, _ in old}
            assert len(cgroups) == 1 and "/hsbuild-server-" in cgroups.pop(), old
        os.kill(api, signal.SIGKILL)  # the API process alone, as a crash would
        crash.release()
        deadline = time.monotonic() + 600
        while _server_pids(port) in ([], [api]) and time.monotonic() < deadline:
            time.sleep(0.1)
        new = _server_pids(port)
        assert new and api not in new, "no new server was launched after the crash"
        survivors = _group(api)
        assert not survivors, f"processes of the crashed server outlived its restart: {survivors}"
        out, err = run.communicate(timeout=1200)
    finally:
        done.set()
        if run.poll() is None:
            run.kill()
        for pid in _server_pids(port):
            os.killpg(pid, signal.SIGKILL)
    assert run.returncode == 0, _why(build, out, err)
    assert "PAUSED (server_unavailable)" in err and "healthy again" in err, err
    assert "stopped answering /health" in err and "restarting it (restart 1)" in err, err
    assert "restarting it (restart 2)" in err, err
    assert not _server_pids(port), "the launched server outlived the run"
    assert not _group(api), "processes of the crashed server remain"
    _one_written_each(build, n)
    with EventLog(layout(build).events, read_only=True) as log:
        paused = log.query("SELECT count(*) FROM events WHERE kind='paused' AND reason='server_unavailable'")[1][0][0]
        resumed = log.query("SELECT count(*) FROM events WHERE kind='resumed' AND reason='server_unavailable'")[1][0][0]
        final_failed = log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0]
        rechecks = log.query("SELECT count(*) FROM events WHERE kind = 'engine_probe' AND "
                             "json_extract(detail, '$.recheck')::BOOLEAN")[1][0][0]
    assert paused >= 2 and resumed >= 2 and final_failed == 0, (paused, resumed, final_failed)
    assert rechecks >= 2, "a restarted server was not checked again before samples went to it"
    # bounded staging: never more files than requests in flight, nor more bytes than that many of the largest
    largest = 300 * 4 * 128 * 2 + 300 * 8 + 4096
    assert peak["files"] <= inflight + 1 and peak["bytes"] <= (inflight + 1) * largest, peak
    assert not list(staging.rglob("*.safetensors"))
    assert _check_against_transformers(build, tiny_llama, "pre_norm") == n


def _resumed(build: Path) -> int:
    """`resumed` events for server_unavailable so far (conftest's live_count: -1 until the run answers)."""
    return live_count(build, "SELECT count(*) FROM events WHERE kind = 'resumed' AND reason = 'server_unavailable'")


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command) of the live (not zombie) processes of process group `pgid`, from /proc."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_bytes()
            fields = stat[stat.rfind(b")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != b"Z":
                out.append((int(p.name), (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return out
