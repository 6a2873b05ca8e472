"""A vLLM build across nodes in connect mode (`hsbuild run BUILD --ray ADDRESS`, no --launch): every node runs
its own server at the build's loopback URL. Ray's multi-node test cluster (a head node and one more, raylets
on this machine bound to 127.0.0.1) shares this machine's one loopback, hence the session's one vLLM server
(tests/vllm_fixture.py; this file runs in the engine tests' xdist group, which holds that server)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_vllm import _check_against_transformers, _init, _one_written_each
from test_vllm_ray import NODE
from vllm_fixture import needs_vllm

from builder.layout import layout
from builder.log.events import EventLog
from builder.log.query import run_query
from builder.run import testhook
from builder.run.coordinator import RunOptions, run_build

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.slow, needs_vllm]


def test_connect_mode_each_nodes_worker_talks_to_the_server_at_the_builds_loopback_url(tmp_path, vllm_server, cli,
                                                                                       hold, monkeypatch):
    """Without --launch every node runs its own server at the build's loopback URL; on this one machine the
    test cluster's two nodes share one loopback, hence the session's one server and staging folder (each
    worker still ingests only its own requests' files)."""
    n = 48  # more tokens than one worker's queue holds (dispatch.QUEUE_TOKENS): both nodes get work
    build = _init(tmp_path, vllm_server, n, seed=5, hi=500)
    # Deterministic, not a race: each worker holds at its first task (the test hook; the run passes HSBUILD_* on
    # to its actors) until both nodes' workers hold one, so the first cannot drain the queue while the second
    # node's actor is still starting (a loaded CI machine starts it seconds late). What is tested is where each
    # worker sends its requests.
    first = hold(1)
    monkeypatch.setenv(testhook.ENV, first.spec)
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    c.add_node(**NODE)
    c.wait_for_nodes()
    lines: list[str] = []

    def both_hold_then_go() -> None:
        try:
            first.wait(2, timeout=600)
        finally:
            first.release()

    t = threading.Thread(target=both_hold_then_go, daemon=True)
    t.start()
    try:
        report = run_build(build, RunOptions(ray=c.address), echo=lines.append)
        t.join(timeout=10)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    assert (report.outcome, report.exit_code) == ("completed", 0), "\n".join(lines)
    _one_written_each(build, n)
    with EventLog(layout(build).events, read_only=True) as log:
        probe = json.loads(log.query("SELECT detail FROM events WHERE kind = 'engine_probe' ORDER BY seq")[1][0][0])
        placed = log.query("SELECT DISTINCT json_extract_string(detail, '$.node') FROM events "
                           "WHERE kind = 'worker_placed'")[1]
        per_node = log.query("SELECT node, written FROM nodes")[1]
    assert set(probe["nodes"].values()) == {vllm_server.url} and len(probe["nodes"]) == 2
    assert len(placed) == 2  # one worker per node's server, and each wrote samples
    assert len(per_node) == 2 and all(k > 0 for _, k in per_node) and sum(k for _, k in per_node) == n, per_node
    assert _check_against_transformers(build, vllm_server.model, "pre_norm") == n
    assert not list(vllm_server.staging.rglob("*.safetensors"))
    assert cli("verify", build).returncode == 0


def _engine_host_pids() -> list[int]:
    """The EngineHost actors' processes (Ray titles an actor's process `ray::EngineHost...`)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"ray::EngineHost" in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def test_a_nodes_server_host_lost_mid_run_stops_its_worker_and_the_other_node_finishes(tmp_path, vllm_server,
                                                                                      hold, monkeypatch):
    """The actor watching one node's server dies (SIGKILL) while the node lives on. That node's server is no
    longer watched (and a launched one died with the actor: its worker's requests would fail, pausing the run
    again and again), so its worker is stopped and lost like one on a lost node (its samples back to pending),
    and the other node finishes the build. (Without the stop, this connect-mode test's worker would go on
    unwatched: no worker_lost.)"""
    n = 40
    build = _init(tmp_path, vllm_server, n, seed=6, hi=500)
    lay = layout(build)
    # mid-run for certain: a worker holds at its 4th task (the test hook; the run passes HSBUILD_* on to its
    # actors) while the host is killed
    held = hold(4)
    monkeypatch.setenv(testhook.ENV, held.env[testhook.ENV])
    monkeypatch.setenv("HSBUILD_GROUP_SAMPLES", "1")
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    c.add_node(**NODE)
    c.wait_for_nodes()
    killed: list[int] = []

    def kill_one_host_once_samples_land() -> None:
        try:
            held.wait(1, timeout=600)
            deadline = time.monotonic() + 60
            while len(pids := _engine_host_pids()) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            if len(pids) == 2:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(run_query(lay, "SELECT count(*) FROM events WHERE kind = 'written'")[1][0][0])
        finally:
            held.release()

    t = threading.Thread(target=kill_one_host_once_samples_land, daemon=True)
    t.start()
    lines: list[str] = []
    try:
        report = run_build(build, RunOptions(ray=c.address), echo=lines.append)
        t.join(timeout=10)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    text = "\n".join(lines)
    assert killed and killed[0] < n, f"no server host was killed mid-run: {killed}"
    assert (report.outcome, report.exit_code) == ("completed", 0), text
    _one_written_each(build, n)
    with EventLog(lay.events, read_only=True) as log:
        lost = log.query("SELECT json_extract_string(detail, '$.message') FROM events WHERE kind = 'worker_lost'")[1]
        states = dict(log.query("SELECT state, count(*) FROM nodes GROUP BY 1")[1])
        pauses = log.query("SELECT count(*) FROM events WHERE kind = 'paused'")[1][0][0]
    assert len(lost) == 1 and "server is gone" in lost[0][0], lost
    assert states == {"up": 1, "gone": 1} and pauses <= 1, (states, pauses)
