"""One build filled by several nodes (`--ray`): Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`,
several raylets on this machine, all on 127.0.0.1) with the build directory shared by all of them (the same
local directory). One node removed mid-run: its samples go back to pending and the others finish them; the
driver SIGKILLed: `resume` with the same cluster finishes. Each time: every sample exactly once, verify clean,
states bit-exact."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import random_rows
from test_run import assert_bit_exact

from builder.layout import layout
from builder.log.events import EventLog
from builder.log.query import run_query, status_snapshot
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@pytest.fixture
def cluster():
    """A head node and two more, one CPU each (every worker is an actor reserving one CPU: one per node)."""
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"  # tests/conftest.py: loopback only
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    nodes = [c.add_node(**NODE) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def written_once(build) -> list[str]:
    """The live samples, each exactly once, all states `written`/`verified`."""
    ids = [item["sample_id"] for item in HiddenStateDataset(build)]
    assert len(ids) == len(set(ids)), "a sample is live twice"
    with EventLog(layout(build).events, read_only=True) as log:
        states = {r["state"] for r in log.samples()}
    assert states <= {"written", "verified"}, states
    return ids


def verify_clean(cli, build) -> None:
    cp = cli("verify", build, "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr


def _per_node_written(url: str) -> dict[str, float]:
    """{node: samples written} from a scrape of the run's --metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.labels["node"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "hsbuild_node_samples_written"}


def report_per_node(cli, build, tmp_path) -> dict:
    """`hsbuild report` (figure 7): its per-node series are what the log's raw events give (each worker's node from
    its `worker_placed` event, its `written` and `worker_lost` events), and the page, in headless Chromium, draws
    them (each node named in the per-node chart). Returns the nodes by id."""
    pytest.importorskip("matplotlib", reason="hsbuild report needs the `report` extra (matplotlib)")
    from browser import chromium, console_errors, figure_svg, render  # noqa: PLC0415 (tests/browser.py)

    page = tmp_path / "report.html"
    cp = cli("report", build, "-o", page, "--json")
    assert cp.returncode == 0, cp.stderr
    got = {n["node"]: n for n in json.loads(cp.stdout)["nodes"]}
    with EventLog(layout(build).events, read_only=True) as log:
        ev = log.query_dicts("SELECT kind, run_id, worker, detail, epoch(ts) AS t FROM events "
                             "WHERE kind IN ('worker_placed', 'worker_lost', 'written') ORDER BY seq")
    placed = {(e["run_id"], e["worker"]): json.loads(e["detail"]) | {"t": e["t"]} for e in ev
              if e["kind"] == "worker_placed"}
    want: dict[str, dict] = {}
    for (_run, _w), p in placed.items():
        n = want.setdefault(p["node"], {"workers": 0, "lost": set(), "writes": [], "since": p["t"]})
        n["workers"] += 1
        n["since"] = min(n["since"], p["t"])
    for e in ev:
        p = placed.get((e["run_id"], e["worker"]))
        if p is not None and e["kind"] == "written":
            want[p["node"]]["writes"].append(e["t"])
        elif p is not None and e["kind"] == "worker_lost":
            want[p["node"]]["lost"].add(e["worker"])
    assert set(got) == set(want)
    for node, w in want.items():
        g = got[node]
        assert (g["workers"], g["workers_lost"], g["written"]) == (w["workers"], len(w["lost"]), len(w["writes"]))
        assert g["state"] == ("gone" if len(w["lost"]) == w["workers"] else "up")
        if w["writes"]:
            assert g["samples_per_s"] == pytest.approx(len(w["writes"]) / (max(w["writes"]) - w["since"]))
    dom, blog = render(chromium(), page, tmp_path / "report.png")
    assert not console_errors(blog), console_errors(blog)
    svg = figure_svg(dom, "workers")
    assert "per Ray node" in svg and all(node[:8] in svg for node in want), svg[:2000]
    return got


def test_a_node_removed_mid_run_its_samples_go_to_the_others(cluster, make_build, cli, hold, monkeypatch,
                                                             tmp_path):
    c, nodes = cluster
    # The run is held by the test hook: each worker stops with its 3rd sample in hand, the 2 before it written
    # one by one (the driver passes HSBUILD_* settings on to its actors). A node goes while its worker holds: it
    # certainly still has work, and the run samples left (at most 6 of the 48 written). Samples of 400 tokens
    # or more: a worker's queue (QUEUE_TOKENS) holds at most 20, so two workers leave the third enough to hold.
    build = make_build(rows=random_rows(48, seed=7, lo=400, hi=800))
    lay = layout(build)
    h = hold(3)
    removed: list[str] = []
    said: list[str] = []
    scraped: list[dict] = []

    def remove_a_held_node() -> None:
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                held = h.wait(timeout=240)  # {worker: pid} of the workers holding now
                try:  # asked of the running coordinator (its query socket), as `hsbuild sql` would
                    placed = dict(run_query(lay, "SELECT json_extract_string(detail, '$.node'), worker FROM events "
                                                 "WHERE kind = 'worker_placed'")[1])
                    done = dict(run_query(lay, "SELECT worker, count(*) FROM events WHERE kind = 'written' "
                                               "GROUP BY 1")[1])
                except Exception:  # noqa: BLE001 - not running yet: look again
                    placed, done = {}, {}
                # a node (not the head) whose worker holds, with a sample of it written
                victim = next((n for n in nodes if placed.get(n.node_id) in held
                               and done.get(placed.get(n.node_id), 0) >= 1), None)
                if victim is not None and sum(done.values()) < 24:
                    url = next(ln.split()[-1] for ln in said if ln.startswith("metrics: http://"))
                    scraped.append(_per_node_written(url))  # --metrics: per node, before the node goes
                    c.remove_node(victim)
                    removed.append(victim.node_id)
                    return
                time.sleep(0.2)
        finally:
            h.release()  # the others go on

    remover = threading.Thread(target=remove_a_held_node, daemon=True)
    remover.start()
    with monkeypatch.context() as m:
        m.setenv("HSBUILD_TEST_HOLD", h.spec)
        m.setenv("HSBUILD_GROUP_SAMPLES", "1")
        report = run_build(build, RunOptions(ray=c.address, workers=3, metrics="127.0.0.1:0"), echo=said.append)
    remover.join(timeout=10)
    assert removed, "no node was removed mid-run"
    assert scraped and len(scraped[0]) == 3 and 1 <= sum(scraped[0].values()) < 48, scraped  # every node's series
    assert (report.outcome, report.exit_code) == ("completed", 0), report.messages
    assert sorted(written_once(build)) == sorted(f"s{i:04d}" for i in range(48))
    with EventLog(lay.events, read_only=True) as log:
        _, lost = log.query("SELECT count(*) FROM events WHERE kind = 'worker_lost'")
        _, per_node = log.query(
            "SELECT json_extract_string(p.detail, '$.node') AS node, count(*) FROM events w JOIN events p "
            "ON p.kind = 'worker_placed' AND p.run_id = w.run_id AND p.worker = w.worker "
            "WHERE w.kind = 'written' GROUP BY 1")
    assert lost == [(1,)]
    assert len(per_node) >= 2  # the samples were written by more than one node
    # status: per-node throughput, and the removed node shown gone
    cp = cli("status", build, "--json")
    nodes = {n["node"]: n for n in json.loads(cp.stdout)["nodes"]}
    assert len(nodes) == 3 and nodes[removed[0]]["state"] == "gone" and nodes[removed[0]]["workers_lost"] == 1
    assert sum(n["written"] for n in nodes.values()) == 48
    others = [n for k, n in nodes.items() if k != removed[0]]
    assert {n["state"] for n in others} == {"up"} and any(n["written"] for n in others)
    assert all(n["samples_per_s"] > 0 for n in others if n["written"])
    text = cli("status", build).stdout
    assert f"node:    {removed[0][:12]} ({socket.gethostname()}): 1 worker(s)" in text and "GONE since" in text, text
    verify_clean(cli, build)
    assert assert_bit_exact(build) == 48
    reported = report_per_node(cli, build, tmp_path)  # the report's figure 7: the removed node drawn gone
    assert reported[removed[0]]["state"] == "gone" and sum(n["written"] for n in reported.values()) == 48


def test_a_worker_lost_after_the_others_ran_out_of_work_is_taken_over_by_an_idle_one(cluster, make_build, hold,
                                                                                      monkeypatch):
    """Small samples: the first worker ready is handed them all (its queue holds up to 8192 tokens), so the
    other has nothing to do from the start. Its actor is killed mid-run: the idle worker must still be there to
    take its samples back (one told to stop as soon as it had nothing to do could not, and the run stopped with
    "0 worker(s) go on")."""
    c, _ = cluster
    n = 20
    build = make_build(rows=random_rows(n, seed=9, lo=300, hi=380))
    lay = layout(build)
    # The busy worker is held by the test hook with its 3rd sample in hand: it is killed mid-run for certain,
    # with at most 2 of the 20 written (the driver passes HSBUILD_TEST_HOLD on to its actors).
    h = hold(3)
    seen: dict = {}

    def kill_the_busy_worker() -> None:
        try:
            h.wait(timeout=240)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                try:
                    pids = dict(run_query(lay, "SELECT worker, CAST(json_extract(detail, '$.pid') AS BIGINT) "
                                               "FROM events WHERE kind = 'worker_placed'")[1])
                    started = dict(run_query(lay, "SELECT worker, count(*) FROM events WHERE kind = 'started' "
                                                  "GROUP BY 1")[1])
                    written = run_query(lay, "SELECT count(*) FROM events WHERE kind = 'written'")[1][0][0]
                except Exception:  # noqa: BLE001 - not running yet: look again
                    pids, started, written = {}, {}, 0
                busy = [w for w, k in started.items() if k >= 2]
                if len(pids) == 2 and busy and written < n // 2:
                    seen.update(busy=busy[0], started=started, written=written)
                    os.kill(pids[busy[0]], signal.SIGKILL)
                    return
                time.sleep(0.05)
        finally:
            h.release()  # the idle worker, taking the samples over, must not hold at its own 3rd

    killer = threading.Thread(target=kill_the_busy_worker, daemon=True)
    killer.start()
    with monkeypatch.context() as m:
        m.setenv("HSBUILD_TEST_HOLD", h.spec)
        report = run_build(build, RunOptions(ray=c.address, workers=2))
    killer.join(timeout=10)
    assert seen, "no worker was killed mid-run"
    # the scenario: at the kill, only the busy worker had started samples (the other had none to do)
    assert set(seen["started"]) == {seen["busy"]}, seen
    assert (report.outcome, report.exit_code) == ("completed", 0), report.messages
    assert sorted(written_once(build)) == sorted(f"s{i:04d}" for i in range(n))
    with EventLog(lay.events, read_only=True) as log:
        lost = log.query("SELECT worker FROM events WHERE kind = 'worker_lost'")[1]
        by = dict(log.query("SELECT worker, count(*) FROM events WHERE kind = 'written' GROUP BY 1")[1])
    assert lost == [(seen["busy"],)]
    assert sum(k for w, k in by.items() if w != seen["busy"]) >= 1, by  # the idle one took its samples over
    assert assert_bit_exact(build) == n


@pytest.mark.claim("crash")
def test_the_driver_killed_then_resumed_on_the_same_cluster(cluster, make_build, cli, hold):
    c, _ = cluster
    build = make_build(rows=random_rows(30, seed=8, lo=200, hi=400), workers="auto")
    lay = layout(build)
    # samples land one by one (the driver passes HSBUILD_* settings on to its actors), and the kill comes mid-run
    # for certain: each worker holds with its 5th sample started (the test hook, HSBUILD_TEST_HOLD passed on too)
    h = hold(5)
    env = {**h.env, "HSBUILD_GROUP_SAMPLES": "1"}
    p = subprocess.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--ray", c.address,
                          "--workers", "2", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        h.wait(proc=p)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and status_snapshot(lay).get("done", 0) < 4 and p.poll() is None:
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()[1]
        assert status_snapshot(lay).get("done", 0) < 30, "the run ended before it could be killed"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # resumed without --workers: the build's `auto` is one worker a live node
    cp = cli("resume", build, "--ray", c.address, "--no-progress", timeout=400)
    assert cp.returncode == 0, cp.stderr
    assert "workers: 3 (auto: one a live node of the Ray cluster, 3" in cp.stderr, cp.stderr
    assert sorted(written_once(build)) == sorted(f"s{i:04d}" for i in range(30))
    verify_clean(cli, build)
    assert assert_bit_exact(build) == 30
    st = json.loads(cli("status", build, "--json").stdout)
    assert st["done"] == 30
    # the nodes of the resumed run: its three workers, one on each node of the same cluster, none gone
    assert [n["workers"] for n in st["nodes"]] == [1, 1, 1] and {n["state"] for n in st["nodes"]} == {"up"}


def test_a_bad_ray_address_is_refused_before_anything_runs(make_build, cli):
    build = make_build(2)
    cp = cli("run", build, "--ray", "nowhere")
    assert cp.returncode == 2 and cp.stderr.startswith("hsbuild run: error: --ray 'nowhere'"), cp.stderr
    assert status_snapshot(layout(build)).get("done", 0) == 0
