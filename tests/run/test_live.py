"""`status` and `sql` from another process while a run is going: answered by the run's coordinator over its
owner-only socket, quickly, with fresh events; writes still refused."""

from __future__ import annotations

import datetime as dt
import json
import signal
import stat
import subprocess
import sys
import time

import forked
from conftest import Hold, wait_written

from builder.layout import layout
from builder.log.lock import inspect_lock
from builder.log.query import run_query, status_snapshot

# The run is held by the test hook at each question (its one worker at tasks 4, 7, ... 16): it is certainly still
# going, and it wrote in between (samples made durable one by one). N: more than the 15 it can write before its
# last hold, so it cannot end while the test asks.
QUESTIONS = 5
N = 20


def test_live_status_and_sql_during_a_run(make_build, cli, hold):
    build = make_build(N, seed=5)
    lay = layout(build)
    holds = [hold(4 + 3 * i) for i in range(QUESTIONS)]
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**Hold.together(*holds), "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        holds[0].wait(proc=p)
        st = status_snapshot(lay)
        assert st.get("running"), st
        sock = inspect_lock(lay).info["socket"]
        assert stat.S_IMODE(__import__("os").stat(sock).st_mode) == 0o600  # only the owner may ask

        seen = []
        for i, h in enumerate(holds):
            h.wait(proc=p)
            # what it wrote since the last question, once the owner committed it (its log commits every 0.5 s)
            wait_written(build, seen[-1] + 1 if seen else 1, p, timeout=30)
            t0 = time.monotonic()
            cols, rows = run_query(lay, "SELECT count(*) AS n, max(ts) AS last FROM events WHERE kind = 'written'")
            answered_in = time.monotonic() - t0
            now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
            last = dt.datetime.fromisoformat(rows[0][1])
            assert answered_in < 2.0
            assert (now - last).total_seconds() < 2.0, "events seen by live queries are too old"
            seen.append(rows[0][0])
            if i < len(holds) - 1:  # (held at the last one until the end)
                h.release()
        assert seen == sorted(seen) and seen[-1] > seen[0], "live counts do not advance"

        cp = cli("status", build, "--json")
        live = json.loads(cp.stdout)
        assert cp.returncode == 0 and live["running"] is True and live["total"] == N
        assert {"paused", "pause_reason", "free_bytes", "usage", "projected_bytes", "final_bytes", "fits"} <= set(live)
        cp = cli("sql", build, "SELECT state, count(*) AS n FROM samples GROUP BY state ORDER BY state", "--csv")
        assert cp.returncode == 0 and cp.stdout.startswith("state,n\n")
        cp = cli("sql", build, "UPDATE events SET kind = 'written'")
        assert cp.returncode == 2 and "read-only" in cp.stderr
        assert p.poll() is None, "the run should still be going"
    finally:
        p.send_signal(signal.SIGINT)
        for h in holds:
            h.release()
        p.communicate(timeout=60)
    # afterwards the same questions are answered from the file
    st = status_snapshot(lay)
    assert st["running"] is False and st["done"] >= seen[-1]
