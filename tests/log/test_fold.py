"""The event fold: the `samples` view (SQL, in a real DuckDB file) agrees with the Python reference fold for any
sequence of events, and the reference itself keeps the invariants users rely on.

Events carry random attempt numbers and timestamps that are NOT monotone in `seq` (a clock stepping backwards,
equal timestamps, several workers' clocks): the fold is defined by `seq` alone, so a view that ordered by `ts`
(or trusted `attempt`) fails here."""

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
RETIRE_REASONS = {"nonfinite": "skipped", "checksum_mismatch": "removed_from_source", "no_space": "skipped"}

# (kind, sample, segment, token_start, reason, attempt, ts offset in seconds): offsets drawn from a small
# range, so they repeat and go backwards between consecutive events
raw_event = st.tuples(
    st.sampled_from(["started", "written", "verified", "failed", "superseded", "retired"]),
    st.sampled_from(SAMPLE_IDS),
    st.sampled_from(["seg-1", "seg-2"]),
    st.integers(0, 1000),
    st.sampled_from(REASONS),
    st.integers(1, 4),
    st.integers(0, 6),
)
# a write and its verification, back to back (verify after write), possibly with an older timestamp
write_then_verify = st.tuples(raw_event, st.integers(-3, 3)).map(
    lambda p: [("written", *p[0][1:]), ("verified", *p[0][1:6], p[0][6] + p[1])])
event_st = st.one_of(raw_event.map(lambda e: [e]), write_then_verify)
events_st = st.lists(event_st, max_size=14).map(lambda groups: [e for g in groups for e in g])


def _events(raw) -> list[Event]:
    out = []
    t0 = dt.datetime(2026, 1, 1)
    for kind, sid, seg, start, reason, attempt, offset in raw:
        ev = Event(kind, run_id="r", sample_id=sid, attempt=attempt, ts=t0 + dt.timedelta(seconds=offset))
        if kind == "written":
            ev.segment, ev.token_start, ev.num_tokens, ev.nbytes, ev.checksums = seg, start, 7, 100, "{}"
        if kind == "failed":
            ev.reason = reason
        if kind == "retired":
            ev.reason = RETIRE_REASONS[reason]
        out.append(ev)
    return out


def _registry():
    z = np.zeros(7, dtype=np.int32)
    return [Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate(SAMPLE_IDS)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=events_st)
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
    by_seq = {e.seq: e for e in events}
    for sid in SAMPLE_IDS:
        mine = [e for e in events if e.sample_id == sid]
        ref = fold(mine)
        r = rows[sid]
        got = (r["state"], r["attempts"], r["segment"], r["token_start"], r["num_tokens"], r["error"],
               r["retired_reason"])
        assert got == ref.as_tuple(), (sid, [(e.seq, e.kind, e.segment, e.ts.second) for e in mine])
        # verified_at is the timestamp of the `verified` event the fold chose (by seq), whatever the clock did
        want_at = by_seq[ref.verified_seq].ts if ref.verified_seq is not None else None
        assert r["verified_at"] == want_at, (sid, [(e.seq, e.kind, e.ts.second) for e in mine])


@given(raw=events_st)
def test_fold_invariants(raw):
    events = _events(raw)
    for seq, e in enumerate(events, start=1):
        e.seq = seq
    for sid in SAMPLE_IDS:
        mine = [e for e in events if e.sample_id == sid]
        s = fold(mine)
        resets = [i for i, e in enumerate(mine) if e.kind == "superseded"]
        since = mine[resets[-1] + 1:] if resets else mine
        assert s.attempts == sum(e.kind == "started" for e in since)  # a changed sample starts over
        main = [e for e in mine if e.kind != "verified"]
        if not main or main[-1].kind == "superseded":
            assert s.state == "pending" and s.segment is None  # a stray `verified` never makes a sample live
            continue
        last = main[-1]
        # the live location is exactly the last `written`, and only while it is the last word
        if last.kind == "written":
            assert (s.segment, s.token_start) == (last.segment, last.token_start)
            later_verified = any(e.kind == "verified" and e.seq > last.seq for e in mine)
            assert s.state == ("verified" if later_verified else "written")
        else:
            assert s.state == last.kind and s.segment is None
            assert (s.retired_reason is not None) == (last.kind == "retired")
