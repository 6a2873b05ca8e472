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

from builder.layout import layout
from builder.log.lock import inspect_lock
from builder.log.query import run_query, status_snapshot


def test_live_status_and_sql_during_a_run(make_build, cli):
    build = make_build(3000, seed=5)  # still going after the questions (it is stopped with Ctrl-C)
    lay = layout(build)
    p = subprocess.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = status_snapshot(lay)
            if st.get("running") and st.get("done", 0) >= 3:  # (a status while it starts has no counts yet)
                break
            time.sleep(0.1)
        assert st.get("running"), st
        sock = inspect_lock(lay).info["socket"]
        assert stat.S_IMODE(__import__("os").stat(sock).st_mode) == 0o600  # only the owner may ask

        seen = []
        for _ in range(5):
            t0 = time.monotonic()
            cols, rows = run_query(lay, "SELECT count(*) AS n, max(ts) AS last FROM events WHERE kind = 'written'")
            answered_in = time.monotonic() - t0
            now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
            last = dt.datetime.fromisoformat(rows[0][1])
            assert answered_in < 2.0
            assert (now - last).total_seconds() < 2.0, "events seen by live queries are too old"
            seen.append(rows[0][0])
            time.sleep(0.4)
        assert seen == sorted(seen) and seen[-1] > seen[0], "live counts do not advance"

        cp = cli("status", build, "--json")
        live = json.loads(cp.stdout)
        assert cp.returncode == 0 and live["running"] is True and live["total"] == 3000
        assert {"paused", "pause_reason", "free_bytes", "usage", "projected_bytes", "final_bytes", "fits"} <= set(live)
        cp = cli("sql", build, "SELECT state, count(*) AS n FROM samples GROUP BY state ORDER BY state", "--csv")
        assert cp.returncode == 0 and cp.stdout.startswith("state,n\n")
        cp = cli("sql", build, "UPDATE events SET kind = 'written'")
        assert cp.returncode == 2 and "read-only" in cp.stderr
        assert p.poll() is None, "the run should still be going"
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    # afterwards the same questions are answered from the file
    st = status_snapshot(lay)
    assert st["running"] is False and st["done"] >= seen[-1]
