"""The event fold: the `samples` view (SQL, in a real DuckDB file) agrees with the Python reference fold for any
sequence of events, and the reference itself keeps the invariants users rely on."""

from __future__ import annotations

import datetime as dt
import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.extract.source import Sample
from builder.log.events import Event, EventLog
from builder.log.fold import fold

SAMPLE_IDS = ["a", "b", "c"]
REASONS = ["nonfinite", "checksum_mismatch", "no_space"]

event_st = st.builds(
    lambda kind, sid, seg, start, reason: (kind, sid, seg, start, reason),
    st.sampled_from(["started", "written", "verified", "failed"]),
    st.sampled_from(SAMPLE_IDS),
    st.sampled_from(["seg-1", "seg-2"]),
    st.integers(0, 1000),
    st.sampled_from(REASONS),
)


def _events(raw) -> list[Event]:
    out = []
    t0 = dt.datetime(2026, 1, 1)
    for i, (kind, sid, seg, start, reason) in enumerate(raw):
        ev = Event(kind, run_id="r", sample_id=sid, attempt=1, ts=t0 + dt.timedelta(seconds=i))
        if kind == "written":
            ev.segment, ev.token_start, ev.num_tokens, ev.nbytes, ev.checksums = seg, start, 7, 100, "{}"
        if kind == "failed":
            ev.reason = reason
        out.append(ev)
    return out


def _registry():
    z = np.zeros(7, dtype=np.int32)
    return [Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate(SAMPLE_IDS)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.lists(event_st, max_size=25))
def test_samples_view_matches_reference_fold(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fold") / "events.duckdb"
    events = _events(raw)
    with EventLog(path) as log:
        log.register_samples(_registry())
        # commit in a few batches, as the coordinator does
        for _, batch in itertools.groupby(enumerate(events), key=lambda p: p[0] // 4):
            log.append([e for _, e in batch])
        rows = {r["sample_id"]: r for r in log.samples()}
    assert set(rows) == set(SAMPLE_IDS)  # exactly one row per source sample
    for sid in SAMPLE_IDS:
        ref = fold([e for e in events if e.sample_id == sid])
        r = rows[sid]
        got = (r["state"], r["attempts"], r["segment"], r["token_start"], r["num_tokens"], r["error"])
        assert got == ref.as_tuple(), (sid, [(e.kind, e.segment) for e in events if e.sample_id == sid])


@given(raw=st.lists(event_st, max_size=30))
def test_fold_invariants(raw):
    events = _events(raw)
    for seq, e in enumerate(events, start=1):
        e.seq = seq
    for sid in SAMPLE_IDS:
        mine = [e for e in events if e.sample_id == sid]
        s = fold(mine)
        assert s.attempts == sum(e.kind == "started" for e in mine)
        main = [e for e in mine if e.kind != "verified"]
        if not main:
            assert s.state == "pending"  # a stray `verified` alone never makes a sample live
            continue
        last = main[-1]
        # the live location is exactly the last `written`, and only while it is the last word
        if last.kind == "written":
            assert (s.segment, s.token_start) == (last.segment, last.token_start)
            later_verified = any(e.kind == "verified" and e.seq > last.seq for e in mine)
            assert s.state == ("verified" if later_verified else "written")
        else:
            assert s.state == last.kind and s.segment is None
