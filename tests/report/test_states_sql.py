"""The report's samples-by-state series (figure 2): its one SQL statement (`queries.MOVES`, one window pass over the
sample events, counted as moves per time bucket) gives, at the end of every bucket, each sample's state by the
Python reference fold of its events up to then, for any sequence of events: stale and repeated verifications, a
`verified` right after a transient failure, restarts (`superseded`), retirements. Run on a real DuckDB log."""

from __future__ import annotations

import datetime as dt
from collections import Counter

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from builder.extract.source import Sample
from builder.log.events import Event, EventLog
from builder.log.fold import TRANSIENT_REASONS, fold
from builder.report import queries as Q
from builder.report.series import STATES, _states

SAMPLE_IDS = ["a", "b", "c"]
KINDS = ["started", "written", "verified", "failed", "superseded", "retired"]
REASONS = ["nonfinite", "error", *sorted(TRANSIENT_REASONS)]
T0 = dt.datetime(2026, 1, 1)

# (kind, sample, failure reason, seconds after the one before: 0 keeps it in the same bucket of 10 s, often)
raw_event = st.tuples(st.sampled_from(KINDS), st.sampled_from(SAMPLE_IDS), st.sampled_from(REASONS),
                      st.sampled_from([0, 0, 1, 4, 10, 25]))


def _events(raw: list[tuple]) -> list[Event]:
    out, t = [], T0
    for kind, sid, reason, step in raw:
        t += dt.timedelta(seconds=step)
        ev = Event(kind, run_id="r", sample_id=sid, ts=t)
        if kind == "written":
            ev.segment, ev.token_start, ev.num_tokens, ev.nbytes, ev.checksums = "seg-1", 0, 7, 100, "{}"
        elif kind == "failed":
            ev.reason = reason
        elif kind == "retired":
            ev.reason = "skipped"
        out.append(ev)
    return out


@settings(max_examples=80, deadline=None)
@given(raw=st.lists(raw_event, min_size=1, max_size=16))
# written, verified twice, a stale verify after a new start, a verify after a transient failure, a restart
@example(raw=[("written", "a", "error", 0), ("verified", "a", "error", 0), ("verified", "a", "error", 10),
              ("started", "a", "error", 10), ("verified", "a", "error", 0), ("failed", "a", "no_space", 10),
              ("verified", "a", "error", 0), ("written", "a", "error", 10), ("superseded", "a", "error", 0),
              ("verified", "a", "error", 10), ("retired", "b", "error", 0)])
def test_states_per_bucket_are_the_fold_of_the_events_up_to_it(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("states") / "events.duckdb"
    events = _events(raw)
    z = np.zeros(7, dtype=np.int32)
    with EventLog(path) as log:
        log.register_samples([Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate(SAMPLE_IDS)])
        log.append(events)
        t0 = log.query("SELECT epoch(min(ts)) FROM events")[1][0][0]
        cols, rows = log.query(Q.MOVES.format(t0=repr(t0), w="10.0"))
    nb = int((events[-1].ts - events[0].ts).total_seconds() // 10) + 1
    got = _states([dict(zip(cols, r, strict=True)) for r in rows], len(SAMPLE_IDS), nb)
    for i in range(nb):
        upto = [e for e in events if (e.ts - events[0].ts).total_seconds() // 10 <= i]
        want = Counter(fold([e for e in upto if e.sample_id == sid]).state for sid in SAMPLE_IDS)
        assert {s: got[s][i] for s in STATES} == {s: want.get(s, 0) for s in STATES}, (i, raw)
