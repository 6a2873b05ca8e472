"""The event fold: the `samples` view (SQL, in a real DuckDB file) agrees with the Python reference fold for any
sequence of events (the fold checkpointed after any of the batches, too), and the reference itself keeps the
invariants users rely on, among them: a start that a transient failure ended is no attempt.

Events carry random attempt numbers and timestamps that are NOT monotone in `seq` (a clock stepping backwards,
equal timestamps, several workers' clocks): the fold is defined by `seq` alone, so a view that ordered by `ts`
(or trusted `attempt`) fails here."""

from __future__ import annotations

import datetime as dt
import itertools

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from builder.extract.source import Sample
from builder.log.events import Event, EventLog, detail
from builder.log.fold import TRANSIENT_REASONS, fold, is_import_start

SAMPLE_IDS = ["a", "b", "c"]
REASONS = ["nonfinite", "checksum_mismatch", "error", *sorted(TRANSIENT_REASONS)]
RETIRE_REASONS = {r: ["skipped", "removed_from_source"][i % 2] for i, r in enumerate(REASONS)}

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
# a start and the failure that ends it, back to back (transient or not), the start an import's or a run's
start_then_fail = st.tuples(raw_event, st.sampled_from(["error", *sorted(TRANSIENT_REASONS)]),
                            st.sampled_from([None, "import", "run"])).map(
    lambda p: [("started", *p[0][1:4], p[0][4], *p[0][5:], p[2]), ("failed", *p[0][1:4], p[1], *p[0][5:])])
event_st = st.one_of(raw_event.map(lambda e: [e]), write_then_verify, start_then_fail)
events_st = st.lists(event_st, max_size=14).map(lambda groups: [e for g in groups for e in g])


def _events(raw) -> list[Event]:
    out = []
    t0 = dt.datetime(2026, 1, 1)
    for kind, sid, seg, start, reason, attempt, offset, *origin in raw:
        ev = Event(kind, run_id="r", sample_id=sid, attempt=attempt, ts=t0 + dt.timedelta(seconds=offset))
        if kind == "started" and origin and origin[0]:
            ev.detail = detail(origin=origin[0])
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


def _cycle(sid: str, reason: str, origin: str | None = None) -> list[tuple]:
    return [("started", sid, "seg-1", 0, "error", 1, 0, origin), ("failed", sid, "seg-1", 0, reason, 1, 0)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=events_st, cuts=st.lists(st.booleans(), min_size=4, max_size=4))
# a start and the transient failure that ends it in one batch, and split across a checkpoint (the failure is the
# sample's first event after it), after an import's start, and after a restart
@example(raw=_cycle("a", "server_unavailable") * 3 + [("started", "a", "seg-1", 0, "error", 1, 0)],
         cuts=[False] * 4)
@example(raw=_cycle("a", "error") + [("superseded", "a", "seg-1", 0, "error", 1, 0)] + _cycle("a", "worker_lost")
         + [("started", "a", "seg-1", 0, "error", 1, 0)], cuts=[False] * 4)
@example(raw=[("started", "a", "seg-1", 0, "error", 1, 0)] * 2 + [("failed", "a", "seg-1", 0, "no_space", 1, 0)]
         + [("verified", "a", "seg-1", 0, "error", 1, 0)] + _cycle("a", "worker_lost"), cuts=[True] * 4)
@example(raw=[("started", "b", "seg-1", 0, "error", 1, 0, "import"), ("started", "a", "seg-1", 0, "error", 1, 0),
              ("superseded", "a", "seg-1", 0, "error", 1, 0), ("started", "b", "seg-1", 0, "error", 1, 0),
              ("failed", "b", "seg-1", 0, "no_space", 1, 0), ("started", "a", "seg-1", 0, "error", 1, 0, "import"),
              ("started", "a", "seg-1", 0, "error", 1, 0), ("failed", "a", "seg-1", 0, "server_unavailable", 1, 0),
              ("failed", "b", "seg-1", 0, "no_space", 1, 0), ("superseded", "b", "seg-1", 0, "error", 1, 0),
              ("failed", "b", "seg-1", 0, "no_space", 1, 0)],
         cuts=[True, False, True, False])
def test_samples_view_matches_reference_fold(tmp_path_factory, raw, cuts):
    path = tmp_path_factory.mktemp("fold") / "events.duckdb"
    events = _events(raw)
    with EventLog(path) as log:
        log.register_samples(_registry())
        # commit in a few batches, as the coordinator does, the fold checkpointed after some of them
        for k, (_, batch) in enumerate(itertools.groupby(enumerate(events), key=lambda p: p[0] // 4)):
            log.append([e for _, e in batch])
            if cuts[k % len(cuts)]:
                log.checkpoint_fold()
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
        main = [e for e in mine if e.kind != "verified"]
        # a changed sample starts over; a start counts unless it was an extraction start and the sample's next
        # word (verify aside) was a transient failure: the environment's fault, no attempt
        after = {a.seq: b for a, b in zip(main, main[1:], strict=False)}
        ended = [e for e in since if e.kind == "started" and not is_import_start(e) and e.seq in after
                 and after[e.seq].kind == "failed" and after[e.seq].reason in TRANSIENT_REASONS]
        assert s.attempts == sum(e.kind == "started" for e in since) - len(ended)
        assert 0 <= s.attempts <= sum(e.kind == "started" for e in mine)
        if not main or main[-1].kind == "superseded":
            assert s.state == "pending" and s.segment is None  # a stray `verified` never makes a sample live
            continue
        last = main[-1]
        # the live location is exactly the last `written`, and only while it is the last word
        if last.kind == "written":
            assert (s.segment, s.token_start) == (last.segment, last.token_start)
            later_verified = any(e.kind == "verified" and e.seq > last.seq for e in mine)
            assert s.state == ("verified" if later_verified else "written")
        else:  # a transient failure sent the sample back: pending, `error` says why its last try ended
            transient = last.kind == "failed" and last.reason in TRANSIENT_REASONS
            assert s.state == ("pending" if transient else last.kind) and s.segment is None
            assert (s.error is not None) == (last.kind == "failed")
            assert (s.retired_reason is not None) == (last.kind == "retired")
