"""`hsbuild run --metrics HOST:PORT`: Prometheus metrics served by the owner while a run lasts, made from the
same status that `hsbuild status --json` gets, scraped over real HTTP from a real run (a subprocess: it is
stopped with SIGINT)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import hsbuild
from prometheus_client.parser import text_string_to_metric_families

from builder.log.metrics import MetricsAddressError, StatusCollector, parse_address

HSBUILD = [sys.executable, "-m", "builder.cli"]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _help(url: str) -> dict[str, str]:
    """{family name: its HELP text} of one scrape: what Prometheus shows a user for each series."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return {fam.name: fam.documentation for fam in text_string_to_metric_families(r.read().decode())}


def _status(build) -> dict:
    cp = hsbuild("status", build, "--json", timeout=60)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def _start(build, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`hsbuild run BUILD --metrics 127.0.0.1:0 FLAGS` and the URL it prints (port 0: any free one)."""
    p = subprocess.Popen([*HSBUILD, "run", str(build), "--metrics", "127.0.0.1:0", "--no-progress", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", line)
        if m:
            return p, m.group(1)
    p.kill()
    raise AssertionError("no metrics URL printed:\n" + "".join(lines))


def _wait_for(p: subprocess.Popen, text: str, timeout: float = 120) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} not printed:\n" + "".join(seen))


def test_a_paused_runs_metrics_equal_its_status_and_name_the_pause(make_build):
    build = make_build(n=30)
    assert hsbuild("run", build, "--limit", "10", "--no-progress").returncode == 0
    # --min-free beyond any disk: the run pauses before its first write and stays paused (its figures still)
    p, url = _start(build, "--min-free", "1000T", "--allow-overcommit")
    try:
        _wait_for(p, "PAUSED (min_free)")
        paused_at = time.monotonic()
        m = _scrape(url)
        st = _status(build)
        assert st["running"] and st["paused"] and st["pause_reason"] == "min_free"
        for state in ("pending", "requeued", "started", "written", "verified", "failed", "retired"):
            assert m[("hsbuild_samples", (("state", state),))] == st[state], state
        assert (st["written"], st["pending"]) == (10, 20)
        assert m[("hsbuild_samples_in_build", ())] == st["total"] == 30
        assert m[("hsbuild_tokens", (("state", "done"),))] == st["tokens_done"]
        assert m[("hsbuild_tokens", (("state", "total"),))] == st["tokens_total"]
        assert m[("hsbuild_written_bytes", ())] == st["bytes_done"]
        assert m[("hsbuild_written_disk_bytes", ())] == st["disk_bytes_done"]
        for level in ("low", "high", "flood"):
            assert m[("hsbuild_watermark_ratio", (("level", level),))] == st[level]
        assert m[("hsbuild_min_free_bytes", ())] == st["min_free"] == 1000 * 2**40
        assert m[("hsbuild_paused", (("reason", "min_free"),))] == 1
        assert m[("hsbuild_stalled", (("filesystem", ""), ("path", ""), ("what", "")))] == 0
        assert m[("hsbuild_workers", ())] == st["workers"]
        assert ("hsbuild_eta_seconds", ()) not in m  # no ETA while paused
        assert m[("hsbuild_run_info", (("backend", ""), ("phase", "running"), ("purpose", "run"),
                                       ("run_id", st["run_id"])))] == 1
        assert 0 < m[("hsbuild_disk_usage_ratio", ())] < 1
        # status as text: the pause's reason on its own line, no ETA while paused
        text = hsbuild("status", build, timeout=60).stdout
        assert any(ln.startswith("PAUSED:  min_free") for ln in text.splitlines()), text
        assert not re.search(r"ETA \d", text), text
        # the going run's duration counts the time paused (no events while paused)
        time.sleep(max(0.0, 3 - (time.monotonic() - paused_at)))
        text = hsbuild("status", build, timeout=60).stdout
        took = re.search(r"^run: +this run: ([\d.]+) s so far \(wall\), 0 written", text, re.M)
        assert took and float(took[1]) >= int(time.monotonic() - paused_at), text
    finally:
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=120)[0]
    assert p.returncode == 130, out
    with pytest.raises(urllib.error.URLError):  # the endpoint ends with the run
        urllib.request.urlopen(url, timeout=5)


def test_a_writing_runs_metrics_equal_its_status(make_build, hold):
    """A run that is writing (not paused), held by the test hook before its 6th sample with 5 durable: a scrape
    and `status --json` give the same counts; let go, it finishes and the run's end closes the endpoint."""
    build = make_build(n=12)
    h = hold(6)
    p, url = _start(build, "--workers", "1", env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        h.wait(1, p)
        deadline = time.monotonic() + 60
        while _status(build)["written"] < 5 and time.monotonic() < deadline:  # the 5th's events committed
            time.sleep(0.1)
        m = _scrape(url)
        st = _status(build)
        assert st["running"] and not st["paused"] and st["written"] == 5, st
        for state in ("pending", "started", "written", "failed"):
            assert m[("hsbuild_samples", (("state", state),))] == st[state], state
        assert m[("hsbuild_tokens", (("state", "done"),))] == st["tokens_done"]
        assert m[("hsbuild_written_bytes", ())] == st["bytes_done"]
        assert m[("hsbuild_paused", (("reason", ""),))] == 0
        # hsbuild_written_bytes is what the log says was written: the written events' nbytes, the encoded
        # (compressed) chunk bytes, and its HELP says so; the states uncompressed are another figure
        cp = hsbuild("sql", build, "SELECT sum(nbytes), sum(num_tokens) FROM events WHERE kind = 'written'", "--csv",
                     timeout=60)
        nbytes, tokens = map(int, cp.stdout.strip().splitlines()[-1].split(","))
        assert m[("hsbuild_written_bytes", ())] == nbytes and tokens == st["tokens_done"]
        doc = _help(url)["hsbuild_written_bytes"]
        assert "compressed" in doc and "uncompressed" not in doc, doc
    finally:
        h.release()
        out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert _status(build)["written"] == 12
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_a_bad_or_taken_metrics_address_is_refused_in_one_line_and_nothing_starts(make_build):
    build = make_build(n=5)
    cp = hsbuild("run", build, "--metrics", "localhost", timeout=120)
    assert cp.returncode == 2 and "--metrics" in cp.stderr and "HOST:PORT" in cp.stderr, cp.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cp = hsbuild("run", build, "--metrics", f"127.0.0.1:{port}", "--no-progress", timeout=120)
    assert cp.returncode == 2, cp.stderr
    err = [ln for ln in cp.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and f"--metrics 127.0.0.1:{port}" in err[0] and "free port" in err[0], cp.stderr
    assert _status(build)["written"] == 0  # nothing ran
    assert hsbuild("run", build, "--no-progress").returncode == 0  # and the lock was released


def test_addresses():
    assert str(parse_address("127.0.0.1:9400")) == "127.0.0.1:9400"
    assert str(parse_address("[::1]:0")) == "::1:0"
    for bad in ("9400", "127.0.0.1:", "127.0.0.1:70000", "a b:1"):
        with pytest.raises(MetricsAddressError, match="--metrics"):
            parse_address(bad)


def test_engine_and_per_node_series_come_from_the_status_fields():
    """The families an engine run and a Ray run add (their status fields as `status --json` prints them)."""
    st = {"run_id": "r", "purpose": "run", "phase": "running", "backend": "vllm", "server": "http://127.0.0.1:8000",
          "server_healthy": False, "server_restarts": 2, "in_flight": 3, "staging_files": 4, "staging_bytes": 5,
          "paused": True, "pause_reason": "engine_down",
          "stalled": {"what": "write", "path": "/b/data", "filesystem": "fuse", "pending_s": 42.0},
          "nodes": [{"node": "n1", "host": "h1", "workers": 2, "workers_lost": 0, "written": 7, "tokens": 70,
                     "nbytes": 700, "samples_per_s": 1.5},
                    {"node": "n2", "host": "h2", "workers": 1, "workers_lost": 1, "written": 3, "tokens": 30,
                     "nbytes": 300, "samples_per_s": None}]}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in StatusCollector(lambda: st).collect() for s in fam.samples}
    assert got[("hsbuild_engine_up", (("backend", "vllm"), ("server", "http://127.0.0.1:8000")))] == 0
    assert got[("hsbuild_engine_restarts", ())] == 2 and got[("hsbuild_staging_bytes", ())] == 5
    assert got[("hsbuild_paused", (("reason", "engine_down"),))] == 1
    assert got[("hsbuild_stalled", (("filesystem", "fuse"), ("path", "/b/data"), ("what", "write")))] == 1
    assert got[("hsbuild_stalled_seconds", ())] == 42
    assert got[("hsbuild_node_samples_written", (("host", "h1"), ("node", "n1")))] == 7
    assert got[("hsbuild_node_workers_lost", (("host", "h2"), ("node", "n2")))] == 1
    assert ("hsbuild_node_samples_per_second", (("host", "h2"), ("node", "n2"))) not in got
