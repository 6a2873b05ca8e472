"""Workers fork from a server that imported torch once (builder/run/worker_start.py), and get what a spawned
worker would: this process's environment as it is when their run starts, not the server's; their stop signals
ignored; a name. A variable read at import changed since the server started: another server imports under it.
A server started by other code in the process, or HSBUILD_WORKER_START=spawn: workers are spawned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import process_group

from builder.run import testhook
from builder.run.coordinator import RunOptions, run_build
from builder.run.worker_start import NAME_PREFIX, running_server, worker_context

ROOT = Path(__file__).resolve().parents[2]


def _proc(pid: int) -> dict[str, str]:
    """A process's name, parent and signal dispositions, from /proc."""
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    return {"comm": comm, "ppid": status["PPid"].strip(), "ignored": status["SigIgn"].strip()}


def _held_run(build: Path, h) -> tuple[int, dict[str, str]]:
    """Run `build` here (the main thread, as a program does) while a thread reads its held worker's /proc and
    releases it: (written, that worker's _proc)."""
    seen: dict[str, str] = {}

    def watch():
        try:
            pid = h.wait(timeout=120)[0]
            seen.update(_proc(pid))
        finally:
            h.release()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    report = run_build(build, RunOptions(workers=1), echo=lambda m: None)
    t.join(130)
    return report.written, seen


def _ignores_stop_signals(mask: str) -> bool:
    bits = int(mask, 16)
    return all(bits >> (sig - 1) & 1 for sig in (2, 15))  # SIGINT, SIGTERM


def test_a_forked_worker_takes_its_runs_environment_not_the_servers(make_build, hold, monkeypatch):
    first = run_build(make_build(3, name="first"), RunOptions(workers=1), echo=lambda m: None)
    assert first.written == 3
    server = running_server()
    assert server is not None and worker_context().get_start_method() == "forkserver"
    h = hold(1)
    monkeypatch.setenv(testhook.ENV, h.spec)  # set after the server started: the worker holds only if it sees it
    written, seen = _held_run(make_build(3, name="second", seed=1), h)
    assert written == 3
    assert seen["comm"] == f"{NAME_PREFIX}0"
    assert int(seen["ppid"]) == server != os.getpid(), seen  # forked from the same server, started once
    assert _ignores_stop_signals(seen["ignored"]), seen


def test_a_variable_read_at_import_changed_gets_a_server_that_imported_under_it(make_build, hold, monkeypatch):
    run_build(make_build(2, name="first"), RunOptions(workers=1), echo=lambda m: None)  # the server is up
    old = running_server()
    assert old is not None
    monkeypatch.setenv("OMP_SCHEDULE", "static")  # torch's OpenMP read it when the server imported torch
    assert worker_context().get_start_method() == "forkserver"
    new = running_server()
    assert new not in (None, old)
    h = hold(1)
    monkeypatch.setenv(testhook.ENV, h.spec)
    written, seen = _held_run(make_build(3, name="second", seed=2), h)
    assert written == 3
    assert int(seen["ppid"]) == new and seen["comm"] == f"{NAME_PREFIX}0", seen  # forked from the new server
    assert _ignores_stop_signals(seen["ignored"]), seen
    deadline = time.monotonic() + 30
    while Path(f"/proc/{old}").exists() and time.monotonic() < deadline:  # the old one exits (and is reaped)
        time.sleep(0.1)
    assert not Path(f"/proc/{old}").exists(), f"the replaced server {old} is still there"
    monkeypatch.delenv("OMP_SCHEDULE")
    assert worker_context().get_start_method() == "forkserver" and running_server() not in (None, new)


def test_a_worker_busy_with_a_sample_dies_with_its_sigkilled_coordinator(make_build, hold):
    """A held worker (a sample in hand, not reading its pipe) learns of its coordinator's death only from its
    parent, the fork server: that server must exit with the coordinator, not live on while a worker does."""
    build = make_build(10, seed=3)
    h = hold(3)
    p = subprocess.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        worker = h.wait(proc=p)[0]
        assert _proc(worker)["comm"] == f"{NAME_PREFIX}0" and int(_proc(worker)["ppid"]) != p.pid  # forked
        p.kill()  # the coordinator alone, not its group
        p.wait()
        deadline = time.monotonic() + 30
        while process_group(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group(p.pid), f"{process_group(p.pid)} outlived their SIGKILLed coordinator"
    finally:
        for pid in process_group(p.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("case", ["foreign server", "asked to spawn"])
def test_workers_are_spawned_where_the_server_is_not_ours_to_use(case):
    script = ("import multiprocessing as mp, os, sys\n"
              "if sys.argv[1] == 'foreign server':\n"
              "    ctx = mp.get_context('forkserver')\n"
              "    ctx.set_forkserver_preload([])\n"
              "    p = ctx.Process(target=os.getpid)\n"
              "    p.start(); p.join()\n"
              "else:\n"
              "    os.environ['HSBUILD_WORKER_START'] = 'spawn'\n"
              "from builder.run.worker_start import running_server, worker_context\n"
              "print(worker_context().get_start_method(), running_server())\n")
    cp = subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["spawn", "None"]


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_hugging_face_run_gets_a_server_that_imported_transformers_and_later_runs_keep_it(tmp_path, make_build,
                                                                                            hold, monkeypatch):
    """transformers' model classes are imported once, in the server, not in each worker: a server without them
    is replaced for a run of a Hugging Face model; the builtin runs after it fork from that one (a superset);
    a variable transformers' libraries read at import, changed, gets another server."""
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    import torch  # noqa: PLC0415

    run_build(make_build(2, name="builtin"), RunOptions(workers=1), echo=lambda m: None)
    plain = running_server()
    assert plain is not None and "_safetensors_rust" not in _maps(plain)  # torch's server: no transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    h = hold(1)
    monkeypatch.setenv(testhook.ENV, h.spec)
    written, seen = _held_run(make_build(3, name="hf", model=str(tmp_path / "llama"), aux_layers=[1]), h)
    monkeypatch.delenv(testhook.ENV)
    hf = running_server()
    assert written == 3 and hf not in (None, plain)
    assert "_safetensors_rust" in _maps(hf) and "tokenizers.abi3" in _maps(hf)  # transformers imported there
    assert int(seen["ppid"]) == hf and seen["comm"] == f"{NAME_PREFIX}0", seen

    run_build(make_build(2, name="builtin-after", seed=4), RunOptions(workers=1), echo=lambda m: None)
    assert running_server() == hf  # kept: it has what a builtin run needs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # huggingface_hub read it when the server imported it
    assert worker_context().get_start_method() == "forkserver" and running_server() not in (None, hf)
