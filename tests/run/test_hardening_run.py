"""Regression tests for defects of the run loop found by trying to break builds (issue 14)."""

from __future__ import annotations

import time

from builder.layout import layout
from builder.log.events import EventLog
from builder.run import coordinator as coordinator_mod
from builder.run.coordinator import RunOptions, run_build
from builder.run.messages import Stop


def _events(build, sql: str) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts(sql)


def test_a_worker_that_finishes_while_the_coordinator_is_busy_is_not_reported_dead(make_build, monkeypatch):
    """The coordinator stalls (a slow commit) right after telling each worker to stop: the workers seal, say
    `exit` and are gone before it reads their last messages. Those messages are still read; nobody died."""
    build = make_build(6, seed=21)
    real_send = coordinator_mod._send

    def send_then_stall(conn, obj):
        real_send(conn, obj)
        if isinstance(obj, Stop):
            time.sleep(3.0)  # the worker seals its segment and exits meanwhile

    monkeypatch.setattr(coordinator_mod, "_send", send_then_stall)
    echoed: list[str] = []
    report = run_build(build, RunOptions(workers=2), echo=echoed.append)
    assert (report.outcome, report.exit_code) == ("completed", 0), echoed
    assert not any("died" in m for m in echoed), echoed
    assert report.written == 6
    states = _events(build, "SELECT state, count(*) AS n FROM samples GROUP BY 1")
    assert states == [{"state": "written", "n": 6}]
    sealed = _events(build, "SELECT segment, reason FROM events WHERE kind = 'segment_sealed'")
    written_segments = {r["segment"] for r in _events(build, "SELECT segment FROM samples")}
    assert {r["segment"] for r in sealed} == written_segments and all(r["reason"] is None for r in sealed)
