"""Issue 30, point 2: every wait is named and bounded, and every way out has its own exit code.

- `run --ray HOST:PORT` where no cluster answers fails in one line (exit 4) naming the address and how to start a
  cluster, instead of Ray's client retrying silently for minutes;
- Ctrl-C while a run waits for its inference server exits 130 (interrupted at a safe point), not 4;
- a build owned by another process is `busy`: its own exit code (5), not the usage-error code.
Real processes throughout (a real unreachable port, a real SIGINT, a real lock held by another process)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import forked
import pytest
from conftest import random_rows, write_jsonl

from builder.errors import EXIT_BUSY, EXIT_INTERRUPTED, EXIT_PREFLIGHT
from builder.layout import layout
from builder.log.events import EventLog
from builder.run.create import init_build


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_run_against_an_unreachable_ray_address_fails_in_one_line(make_build, cli):
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    build = make_build(2)
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    cp = cli("run", build, "--ray", address, "--no-progress", timeout=120)
    waited = time.monotonic() - t0
    err = cp.stderr.strip().splitlines()
    assert cp.returncode == EXIT_PREFLIGHT, cp.stderr
    assert len(err) == 1 and address in err[0] and "ray start --head" in err[0], cp.stderr
    assert waited < 90, f"took {waited:.0f} s"  # (the bound is 10 s of connecting; the rest is start-up)
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.count("started") == 0


def test_ctrl_c_while_waiting_for_the_server_exits_130(tmp_path):
    """A vLLM build in connect mode whose server is not up: the run waits for it, saying so; Ctrl-C stops it at
    once with the interrupted code, nothing sent, the build as it was."""
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    del transformers
    from vllm_fixture import VOCAB, make_model

    model = make_model(tmp_path / "model")
    staging = tmp_path / "staging"
    staging.mkdir()
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(4, vocab=VOCAB))
    build = init_build(tmp_path / "b", src, model=str(model), backend="vllm",
                       server=f"http://127.0.0.1:{_closed_port()}", staging=str(staging)).root
    run = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "waiting for" not in seen and time.monotonic() < deadline:
            seen += run.stderr.readline()
        assert "waiting for" in seen, seen
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == EXIT_INTERRUPTED, seen + err
    assert "stopping at a safe point" in seen + err and "Traceback" not in err
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.count("started") == 0
        assert log.query("SELECT reason FROM events WHERE kind = 'run_finished'")[1] == [("interrupted",)]


def test_a_build_another_process_owns_is_busy_with_its_own_exit_code(make_build, cli):
    from builder.log.lock import BuildLock

    build = make_build(2)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from builder.layout import layout; from builder.log.lock import BuildLock\n"
        f"lock = BuildLock(layout({str(build)!r}), 'run').acquire(); print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for cmd in (("run", build, "--no-progress"), ("verify", build, "--quick", "--no-progress")):
            cp = cli(*cmd)
            err = cp.stderr.strip().splitlines()
            assert cp.returncode == EXIT_BUSY, cp.stderr
            assert len(err) == 1 and "busy" in err[0] and f"pid {holder.pid}" in err[0], cp.stderr
    finally:
        holder.kill()
        holder.wait()
    assert BuildLock(layout(build), "run").acquire() is not None  # free again once the owner is gone
