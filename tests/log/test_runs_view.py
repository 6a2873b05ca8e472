"""The `runs` view: runs in the log's order (a clock set back must not make an older run the last one), and the time
each spent extracting (pauses and stalls left out, overlaps counted once), over which its rates are given.

Events written here with the times a clock set back an hour would give them (a real run's own timing with a pause
is tests/space/test_storage.py's); `status` reads the build as a user's `hsbuild status` does."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from builder.layout import layout
from builder.log.events import Event, EventLog, detail

T0 = dt.datetime(2026, 12, 7, 12, 0, 0)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def _run(run_id: str, t: float, samples: list[str], moves: list[tuple[float, Event]]) -> list[Event]:
    """A run starting at T0+t: `run_started`, then `moves` (offsets from t), then `run_finished`."""
    evs = [Event("run_started", run_id=run_id, ts=at(t))]
    for off, ev in moves:
        ev.run_id, ev.ts = run_id, at(t + off)
        evs.append(ev)
    evs.append(Event("run_finished", run_id=run_id, reason="completed", ts=at(t + max(o for o, _ in moves) + 1)))
    assert all(ev.sample_id in samples or ev.sample_id is None for ev in evs)
    return evs


def test_runs_are_ordered_by_the_log_and_rated_over_the_time_they_extracted(make_build, cli):
    build = make_build(4)
    with EventLog(layout(build).events) as log:
        a, b, c, d = sorted(log.registered())
        # run A at 13:00; then the clock is set back an hour: run B starts "at 12:00", after A in the log
        log.append(_run("run-a", 3600, [a], [(1, Event("started", sample_id=a, attempt=1)),
                                             (2, Event("written", sample_id=a, num_tokens=10, nbytes=1000))]))
        stall = {"what": "log commit", "path": str(build), "filesystem": "fuse at /x", "pending_s": 4.0}
        log.append(_run("run-b", 0, [b, c, d], [
            (1, Event("started", sample_id=b, attempt=1)),
            (3, Event("written", sample_id=b, num_tokens=10, nbytes=1000)),
            (3, Event("started", sample_id=c, attempt=1)),
            (4, Event("paused", reason="high_watermark")),
            # a storage stall from +5 to +9, told once the log could commit again (its own times in detail)
            (9, Event("stalled", detail=detail(**stall, since=at(5).replace(tzinfo=dt.UTC).timestamp()))),
            (9, Event("unstalled", detail=detail(**stall, since=at(5).replace(tzinfo=dt.UTC).timestamp(),
                                                 duration_s=4.0))),
            (8, Event("resumed", reason="high_watermark")),  # (committed after the stall's events: seq order)
            (12, Event("written", sample_id=c, num_tokens=20, nbytes=3000)),
            (12, Event("started", sample_id=d, attempt=1)),  # in hand when the run ended: not extracting time
        ]))
        runs = log.query_dicts("SELECT run_id, started_seq, duration_s, active_s, written, samples_per_s, "
                               "tokens_per_s FROM runs")
    assert [r["run_id"] for r in runs] == ["run-a", "run-b"]  # the log's order, though B "started" an hour earlier
    rb = runs[1]
    # B: wall 13 s; extracting from +1 (first started) to +12 (last written) = 11 s, less the pause (+4..+8) and the
    # stall (+5..+9) where they overlap it: +4..+9, 5 s, counted once
    assert rb["duration_s"] == pytest.approx(13.0) and rb["active_s"] == pytest.approx(6.0)
    assert rb["samples_per_s"] == pytest.approx(2 / 6.0, abs=1e-3) and rb["tokens_per_s"] == pytest.approx(5.0)
    assert runs[0]["active_s"] == pytest.approx(1.0) and runs[0]["samples_per_s"] == pytest.approx(1.0)

    st = json.loads(cli("status", build, "--json", check=True).stdout)
    assert st["last_run"]["run_id"] == "run-b" and st["last_run"]["active_s"] == pytest.approx(6.0)
    line = next(ln for ln in cli("status", build, check=True).stdout.splitlines() if ln.startswith("run:"))
    assert "last run (completed): 13.0 s (wall), 2 written: 0.33 samples/s" in line and "over 6.0 s extracting" in line, line
