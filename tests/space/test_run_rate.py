"""A run's rate is over the time it spent extracting, its wall time beside it (issue 41, point 12: a dead run said
3.11 samples/s over 25 s while it ran 11 s). A real run on a real small volume (a tmpfs this test mounts: root
only, skipped otherwise) pauses mid-way at the high watermark for a few seconds, goes on, and is then killed
(kill -9): its log has a gap, and it died. Its `runs` row and `status` give the wall time and the rate over the
time it extracted: the pause, its start-up and what came after its last write left out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import forked
import pytest
from conftest import POLL_OWNER_S, Hold, random_rows, wait_written, write_jsonl

from builder.config import Watermarks
from builder.layout import layout
from builder.log.events import EventLog
from builder.log.query import status_snapshot
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
PAUSE_S = 3.0


def test_a_dead_runs_rate_leaves_out_its_pause(tmp_path, tmpfs, cli):
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(12, seed=4, lo=20, hi=40))
    build = init_build(tmpfs / "build", src, model=MODEL,
                       watermarks=Watermarks(low=0.85, high=0.90, flood=0.99, min_free=0)).root
    first, second = Hold(tmp_path / "h1", 4), Hold(tmp_path / "h2", 8)
    env = {**Hold.together(first, second), "HSBUILD_GROUP_SAMPLES": "1"}
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    filler = tmpfs / "filler"
    try:
        first.wait(1, p)
        wait_written(build, 3, p)
        st = os.statvfs(tmpfs)  # the volume to 93%: past high (90%), below flood
        with open(filler, "wb") as f:
            f.write(b"\xff" * max(0, int(st.f_blocks * 0.93 - (st.f_blocks - st.f_bavail)) * st.f_frsize))
        first.release()
        deadline = time.monotonic() + 60
        while not status_snapshot(layout(build)).get("paused"):
            assert p.poll() is None and time.monotonic() < deadline, "no pause"
            time.sleep(POLL_OWNER_S)
        time.sleep(PAUSE_S)  # the gap: the run is alive, paused, extracts nothing
        filler.unlink()  # room again: it resumes by itself
        second.wait(1, p)  # ... and writes up to its 8th sample, held there
        wait_written(build, 7, p)
        time.sleep(1.0)  # alive after its last write, then killed
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        filler.unlink(missing_ok=True)

    with EventLog(layout(build).events, read_only=True) as log:
        [run] = log.query_dicts("SELECT * FROM runs")
        (pause,) = log.query("SELECT epoch(max(ts) FILTER (WHERE kind = 'resumed')) - "
                             "epoch(min(ts) FILTER (WHERE kind = 'paused')) FROM events")[1][0]
        (span,) = log.query("SELECT epoch(max(ts) FILTER (WHERE kind = 'written')) - "
                            "epoch(min(ts) FILTER (WHERE kind = 'started')) FROM events")[1][0]
    assert run["outcome"] == "unfinished" and run["written"] == 7 and run["pauses"] == 1, run
    assert pause >= PAUSE_S
    # extracting: from the first sample started to the last written, less the pause
    assert run["active_s"] == pytest.approx(span - pause, abs=0.002) and run["active_s"] > 0
    assert run["duration_s"] > run["active_s"] + pause - 0.01  # the wall time keeps it all
    assert run["samples_per_s"] == pytest.approx(7 / run["active_s"], rel=2e-3)

    st = json.loads(cli("status", build, "--json", check=True).stdout)
    assert st["last_run"]["active_s"] == run["active_s"] and st["last_run"]["samples_per_s"] == run["samples_per_s"]
    line = next(ln for ln in cli("status", build, check=True).stdout.splitlines() if ln.startswith("run:"))
    assert (f"last run (unfinished): {run['duration_s']:.1f} s (wall), 7 written: {run['samples_per_s']:.2f} "
            f"samples/s") in line and f"over {run['active_s']:.1f} s extracting" in line, line
