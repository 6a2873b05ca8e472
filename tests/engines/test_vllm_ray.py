"""A vLLM build across nodes (`hsbuild run BUILD --ray ADDRESS --launch`): Ray's own multi-node test cluster
(`ray.cluster_utils.Cluster`: a head node and one more, raylets on this machine bound to 127.0.0.1) with the
build directory shared by both. hsbuild launches one real vLLM CPU server per node (each on its own loopback
port, staging into its own folder) and places one worker beside each.

(Connect mode, each node running its own server: test_vllm_ray_connect.py.) Mid-run, one node's server is killed with -9: the run pauses, that node's host restarts it, the run resumes.
Then the other node is removed: its samples go back to pending and the head node finishes them. Every sample
exactly once, states equal to a transformers forward pass, verify clean, no server outlives the run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from conftest import Hold, random_rows, set_config, write_jsonl
from test_vllm import _check_against_transformers, _one_written_each
from test_vllm_launch import _server_pids
from vllm_fixture import ENGINE_ARGS, VOCAB, free_port, needs_vllm

from builder.layout import layout
from builder.log.events import EventLog
from builder.log.query import run_query
from builder.run import dispatch, testhook
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.slow, needs_vllm]
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


def _ask(lay, sql: str) -> list:
    try:  # asked of the running coordinator (its query socket), as `hsbuild sql` would
        return run_query(lay, sql)[1]
    except Exception:  # noqa: BLE001 - not running yet (or between runs): nothing yet
        return []


def test_one_server_per_node_a_server_killed_and_a_node_removed(tmp_path, tiny_llama, monkeypatch, hold, cli):
    # Deterministic (the test hook, builder/run/testhook.py; the run passes HSBUILD_* on to its actors): a worker
    # holds at its 5th task while the head node's server is killed, and the other node's worker holds again at
    # its 15th, after the run resumed, while its node is removed. So both happen mid-run, whatever the speed.
    # A worker is handed its window (in flight + 1) and no deeper queue of small samples (dispatch.QUEUE_SAMPLES,
    # up to 64 of them, 8192 tokens, to whichever worker asks first): the head node's worker, held at its 15th,
    # then holds at most 19 samples, so the other node's certainly gets its 15 of the 40.
    n = 40
    monkeypatch.setattr(dispatch, "QUEUE_SAMPLES", 0)
    first, second = hold(5), hold(15)
    monkeypatch.setenv(testhook.ENV, Hold.together(first, second)[testhook.ENV])
    monkeypatch.setenv("HSBUILD_GROUP_SAMPLES", "1")
    # loopback only, inherited by the raylets (hence by the actors that launch the servers; the launched
    # command sets it too)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    staging = tmp_path / "staging"
    staging.mkdir()
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(n, 33, vocab=VOCAB, hi=200))
    build = init_build(tmp_path / "b", src, model=str(tiny_llama), backend="vllm",
                       server=f"http://127.0.0.1:{free_port()}", staging=str(staging), inflight=4).root
    set_config(build, engine_args=list(ENGINE_ARGS))  # a short context for the tiny model
    lay = layout(build)

    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"  # tests/conftest.py: loopback only
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    other = c.add_node(**NODE)
    c.wait_for_nodes()
    events: list[str] = []
    lines: list[str] = []

    def disturb() -> None:
        try:
            deadline = time.monotonic() + 1800  # 2 cores, shared with the suite
            first.wait(1, timeout=1800)
            servers: dict = {}
            while time.monotonic() < deadline and not servers:
                rows = _ask(lay, "SELECT detail FROM events WHERE kind = 'engine_probe'")
                servers = json.loads(rows[0][0])["nodes"] if rows else {}
                time.sleep(0.2)
            head = next(k for k in servers if k != other.node_id[:12])
            port = int(servers[head].rsplit(":", 1)[1])
            for pid in _server_pids(port):  # the head node's server and its engine process, as a crash would
                os.killpg(pid, signal.SIGKILL)
            events.append("killed")
            first.release()
            while time.monotonic() < deadline and not _ask(lay, "SELECT 1 FROM events WHERE kind = 'resumed'"):
                time.sleep(0.2)
            # the other node's worker, held at its 15th task once the run has resumed
            placed = {}
            while time.monotonic() < deadline:
                placed = dict(_ask(lay, "SELECT worker, json_extract_string(detail, '$.node') FROM events "
                                        "WHERE kind = 'worker_placed'"))
                theirs = {w for w, node in placed.items() if (node or '')[:12] == other.node_id[:12]}
                if any((second.folder / f"reached-{w}").exists() for w in theirs):
                    break
                time.sleep(0.2)
            else:
                return
            c.remove_node(other)
            events.append("removed")
        finally:
            first.release()
            second.release()

    t = threading.Thread(target=disturb, daemon=True)
    t.start()
    try:
        report = run_build(build, RunOptions(ray=c.address, launch=True), echo=lines.append)
        t.join(timeout=30)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    text = "\n".join(lines)
    assert events == ["killed", "removed"], text
    assert (report.outcome, report.exit_code) == ("completed", 0), text
    assert "PAUSED (server_unavailable)" in text and "restarting it" in text and "healthy again" in text, text
    _one_written_each(build, n)
    with EventLog(lay.events, read_only=True) as log:
        probe = json.loads(log.query("SELECT detail FROM events WHERE kind = 'engine_probe' ORDER BY seq")[1][0][0])
        lost = log.query("SELECT count(*) FROM events WHERE kind = 'worker_lost'")[1][0][0]
        _, per_node = log.query(
            "SELECT json_extract_string(p.detail, '$.node') AS node, count(*) FROM events w JOIN events p "
            "ON p.kind = 'worker_placed' AND p.run_id = w.run_id AND p.worker = w.worker "
            "WHERE w.kind = 'written' GROUP BY 1")
    # one server per node, each on its own loopback port, staging into its own folder (all gone now)
    assert len(probe["nodes"]) == 2 and len(set(probe["nodes"].values())) == 2
    assert all(u.startswith("http://127.0.0.1:") for u in probe["nodes"].values())
    assert sorted(p.name for p in staging.iterdir()) == sorted(f"node-{k}" for k in probe["nodes"])
    assert not list(staging.rglob("*.safetensors"))
    assert sorted((lay.root / "logs").glob("server-*.log")) and lost == 1 and len(per_node) == 2
    for url in probe["nodes"].values():
        assert not _server_pids(int(url.rsplit(":", 1)[1])), f"the server at {url} outlived the run"
    nodes = {nd["node"]: nd for nd in json.loads(cli("status", build, "--json").stdout)["nodes"]}
    assert nodes[other.node_id]["state"] == "gone" and sum(nd["written"] for nd in nodes.values()) == n
    assert _check_against_transformers(build, tiny_llama, "pre_norm") == n
    cp = cli("verify", build)
    assert cp.returncode == 0, cp.stdout + cp.stderr

