"""The `samples` view was rewritten for speed (one aggregation per sample instead of window functions, for logs
of millions of events): on any sequence of events it gives exactly what the previous definition gave, every
column, every row, and `progress` agrees with it. The previous definition is kept here as the reference (with
one later rule: a start that a transient failure ended is no attempt, written here with a window).

(tests/log/test_fold.py checks the view against the Python fold; this covers the columns that fold does not
model: source rows and fingerprints after `superseded`/`row_moved`, sizes, details, notes, timestamps.)"""

from __future__ import annotations

import datetime as dt
import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from builder.extract.source import Sample
from builder.log.checksums import FIELDS
from builder.log.events import Event, EventLog

REFERENCE_SAMPLES_VIEW = """
CREATE OR REPLACE VIEW samples_reference AS
WITH se AS (
    SELECT * FROM events
    WHERE sample_id IS NOT NULL AND kind IN ('started', 'written', 'verified', 'failed', 'superseded', 'retired')
),
last_main AS (
    SELECT * FROM se WHERE kind <> 'verified'
    QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1
),
last_verified AS (
    SELECT sample_id, max(seq) AS vseq, arg_max(ts, seq) AS vts FROM se WHERE kind = 'verified' GROUP BY sample_id
),
resets AS (
    SELECT sample_id, max(seq) AS eseq FROM se WHERE kind = 'superseded' GROUP BY sample_id
),
current_src AS (
    SELECT sample_id, fingerprint, num_tokens, TRY_CAST(json_extract(detail, '$.row') AS BIGINT) AS row_idx
    FROM events WHERE sample_id IS NOT NULL AND kind IN ('superseded', 'row_moved')
    QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1
),
-- an extraction start (not an import's) whose next word (verify aside) is a transient failure is no attempt
ended AS (
    SELECT sample_id, seq FROM (
        SELECT sample_id, seq, kind, detail, lead(kind) OVER w AS next_kind, lead(reason) OVER w AS next_reason
        FROM se WHERE kind <> 'verified' WINDOW w AS (PARTITION BY sample_id ORDER BY seq))
    WHERE kind = 'started' AND next_kind = 'failed' AND next_reason IN ('no_space', 'server_unavailable', 'worker_lost')
      AND coalesce(json_extract_string(detail, '$.origin'), '') <> 'import'
),
agg AS (
    SELECT se.sample_id,
           count(*) FILTER (WHERE kind = 'started' AND seq > coalesce(e.eseq, 0)
                            AND seq NOT IN (SELECT seq FROM ended)) AS attempts,
           count(*) FILTER (WHERE kind = 'started') AS starts,
           max(ts) AS updated_at
    FROM se LEFT JOIN resets e USING (sample_id) GROUP BY se.sample_id
)
SELECT
    s.sample_id,
    coalesce(c.row_idx, s.row_idx) AS row_idx,
    coalesce(c.fingerprint, s.fingerprint) AS fingerprint,
    CASE
        WHEN m.kind IS NULL OR m.kind = 'superseded' THEN 'pending'
        WHEN m.kind = 'written' AND v.vseq > m.seq THEN 'verified'
        -- a transient failure (the environment's fault) sent the sample back: pending
        WHEN m.kind = 'failed' AND m.reason IN ('no_space', 'server_unavailable', 'worker_lost') THEN 'pending'
        ELSE m.kind
    END AS state,
    coalesce(a.attempts, 0) AS attempts,
    coalesce(c.num_tokens, s.num_tokens) AS source_tokens,
    CASE WHEN m.kind = 'written' THEN m.num_tokens END AS num_tokens,
    CASE WHEN m.kind = 'written' THEN m.nbytes END AS nbytes,
    CASE WHEN m.kind = 'written' THEN TRY_CAST(json_extract(m.detail, '$.disk_bytes') AS BIGINT) END AS disk_bytes,
    CASE WHEN m.kind = 'written' THEN m.segment END AS segment,
    CASE WHEN m.kind = 'written' THEN m.token_start END AS token_start,
    CASE WHEN m.kind = 'written' THEN checksums_text(m.checksums) END AS checksums,  -- (the JSON text: as stored, later)
    CASE WHEN m.kind = 'failed' THEN m.reason END AS error,
    CASE WHEN m.kind = 'failed' THEN m.detail END AS error_detail,
    CASE WHEN m.kind = 'written' AND v.vseq > m.seq THEN v.vts END AS verified_at,
    a.updated_at,
    CASE WHEN m.kind = 'retired' THEN m.reason END AS retired_reason,
    CASE WHEN m.kind = 'retired' THEN json_extract_string(m.detail, '$.note') END AS retired_note,
    coalesce(a.starts, 0) AS starts,
    CASE WHEN m.kind IN ('written', 'retired') THEN json_extract_string(m.detail, '$.finish_reason') END
        AS finish_reason,
    CASE WHEN m.kind IN ('written', 'retired') THEN TRY_CAST(json_extract(m.detail, '$.generated') AS BIGINT) END
        AS generated
FROM source_samples s
LEFT JOIN last_main m USING (sample_id)
LEFT JOIN last_verified v USING (sample_id)
LEFT JOIN agg a USING (sample_id)
LEFT JOIN current_src c USING (sample_id);
"""

SAMPLE_IDS = ["a", "b", "c", "d"]  # "d" is registered but may have no events; "x" has events but no registration
KINDS = ["started", "written", "verified", "failed", "superseded", "retired", "row_moved", "run_started"]

raw_event = st.tuples(
    st.sampled_from(KINDS),
    st.sampled_from(SAMPLE_IDS[:3] + ["x"]),
    st.integers(0, 6),  # ts offset (not monotone in seq)
    st.integers(0, 3),  # variant: which reason / detail / size
)
events_st = st.lists(raw_event, max_size=24)

FAIL_REASONS = ["nonfinite", "checksum_mismatch", "no_space", "import_truncated"]
DETAILS = [None, json.dumps({"disk_bytes": 4096, "seconds": 0.1, "finish_reason": "length", "generated": 3}),
           json.dumps({"row": 7, "note": "n"}),
           json.dumps({"note": "too long", "row": "not a number"}),
           # a written event's: without a finish_reason (the fold keeps none of it), with one but no `generated`
           json.dumps({"disk_bytes": 512, "seconds": 0.2, "truncated": 3}),
           json.dumps({"disk_bytes": 512, "finish_reason": "stop"})]


def _events(raw) -> list[Event]:
    t0 = dt.datetime(2026, 1, 1)
    out = []
    for kind, sid, offset, v in raw:
        ev = Event(kind, run_id="r", sample_id=None if kind == "run_started" else sid, attempt=v + 1,
                   ts=t0 + dt.timedelta(seconds=offset), fingerprint=f"fp{v}" if v else None, detail=DETAILS[v])
        if kind in ("written", "verified"):
            ev.segment, ev.token_start, ev.num_tokens, ev.nbytes = f"seg-{v}", 100 * v, 7 + v, 1000 + v
            # hsbuild's own text (stored compact) or another (stored as it is)
            ev.checksums = json.dumps({f: f"crc32c:{v:08x}" for f in (FIELDS if v % 2 else FIELDS[:1])}, sort_keys=True)
        if kind == "failed":
            ev.reason = FAIL_REASONS[v]
        if kind == "retired":
            ev.reason = ["skipped", "removed_from_source"][v % 2]
        if kind in ("superseded", "row_moved"):
            ev.num_tokens = 5 + v if v != 2 else None
            ev.reason = "source_changed" if kind == "superseded" else None
        out.append(ev)
    return out


def _registry():
    z = np.zeros(7, dtype=np.int32)
    return [Sample(sid, i, z, z.astype(np.uint8), f"reg-{sid}") for i, sid in enumerate(SAMPLE_IDS)]


def _rows(log: EventLog, view: str) -> list[tuple]:
    return sorted(log.query(f"SELECT * FROM {view}")[1], key=lambda r: r[0])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=events_st, cuts=st.lists(st.booleans(), min_size=12, max_size=12))
# a state split across a checkpoint: attempts before and after it, a restart after it, a `verified` after it
@example(raw=[("started", "a", 0, 0)] * 3, cuts=[True] + [False] * 11)
@example(raw=[("started", "a", 0, 0), ("started", "a", 0, 1), ("superseded", "a", 1, 2), ("started", "a", 2, 0)],
         cuts=[True, False, True] + [False] * 9)
@example(raw=[("started", "b", 0, 0), ("written", "b", 1, 1), ("row_moved", "b", 1, 1), ("verified", "b", 0, 1),
              ("started", "b", 3, 0)], cuts=[False, True] + [False] * 10)
def test_samples_view_equals_its_reference_definition(tmp_path_factory, raw, cuts):
    """Also with the fold checkpointed (schema/events.sql, `fold_checkpoint`) after any of the batches, more than
    once, and with a sample registered after a checkpoint: the checkpoint changes no answer."""
    path = tmp_path_factory.mktemp("view") / "events.duckdb"
    with EventLog(path) as log:
        log.register_samples(_registry()[:3])
        log.con.execute(REFERENCE_SAMPLES_VIEW)
        for k, (_, batch) in enumerate(itertools.groupby(enumerate(_events(raw)), key=lambda p: p[0] // 2)):
            log.append([e for _, e in batch])
            if cuts[k % len(cuts)]:
                log.checkpoint_fold()
                assert log.fold_tail() == 0
                assert _rows(log, "samples") == _rows(log, "samples_reference")
        log.register_samples(_registry()[3:])  # "d": registered last (it may have events already)
        if cuts[-1]:
            log.checkpoint_fold()
        cols = log.query("SELECT * FROM samples LIMIT 0")[0]
        assert cols == log.query("SELECT * FROM samples_reference LIMIT 0")[0]
        assert _rows(log, "samples") == _rows(log, "samples_reference")
        types = log.query("SELECT column_name, column_type FROM (DESCRIBE samples)")[1]
        assert types == log.query("SELECT column_name, column_type FROM (DESCRIBE samples_reference)")[1]
        # progress folds the view: its counts are the view's
        # (a sample a transient failure sent back is pending; `requeued` says how many of the pending are such)
        prog = log.progress()
        transient = "('no_space', 'server_unavailable', 'worker_lost')"
        counts = dict(log.query("SELECT state, count(*) FROM samples_reference GROUP BY 1")[1])
        for state in ("pending", "started", "written", "verified", "failed", "retired"):
            assert prog[state] == counts.get(state, 0)
        assert prog["requeued"] == log.query(f"SELECT count(*) FROM samples_reference WHERE state = 'pending' AND "
                                             f"error IN {transient}")[1][0][0]
        # ... and so are what `status` takes from the same pass: failures per reason, the projection's inputs
        reasons = log.query("SELECT coalesce(error, 'unknown'), count(*) FROM samples_reference "
                            "WHERE state = 'failed' GROUP BY 1")[1]
        assert (prog["failed_by_reason"] or {}) == dict(reasons)
        todo, todo_tokens, disk = log.query(
            "SELECT count(*) FILTER (WHERE state NOT IN ('written', 'verified', 'retired')), "
            "coalesce(sum(source_tokens) FILTER (WHERE state NOT IN ('written', 'verified', 'retired')), 0), "
            "coalesce(sum(coalesce(disk_bytes, nbytes)) FILTER (WHERE state IN ('written', 'verified')), 0) "
            "FROM samples_reference")[1][0]
        assert (prog["todo_samples"], prog["todo_tokens"], prog["disk_bytes_done"]) == (todo, todo_tokens, disk)


def test_the_live_replica_answers_as_the_file_across_checkpoints(tmp_path):
    """`hsbuild sql` during a run (the owner's in-memory replica, log/sandbox.py) sees the same states as the
    file, before and after the owner replaces the fold's checkpoint."""
    from builder.log.sandbox import LiveReplica

    raw = [(k, sid, i % 5, i % 4) for i, (k, sid) in enumerate(itertools.product(KINDS, SAMPLE_IDS[:3] + ["x"]))]
    events = _events(raw)
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples(_registry())
        log.con.execute(REFERENCE_SAMPLES_VIEW)
        replica = LiveReplica(log)
        for part in (events[:10], events[10:20], events[20:]):
            log.append(part)
            assert sorted(replica.query("SELECT * FROM samples")[1]) == _rows(log, "samples_reference")
            log.checkpoint_fold()
            assert sorted(replica.query("SELECT * FROM samples")[1]) == _rows(log, "samples_reference")
        assert replica.query("SELECT count(*) FROM fold_checkpoint")[1][0][0] > 0


@pytest.mark.parametrize("view", ["sample_fold", "samples", "progress", "runs", "gpu_stats", "doctor_checks", "nodes"])
def test_a_live_query_gets_every_view_it_reads_and_answers_as_the_owners_log(tmp_path, view):
    """A live query's throwaway instance gets only the views its SQL names and the views those read
    (log/sandbox.py): each view, read directly, through a CTE, or by name in a string, answers as the owner's
    own log does."""
    from builder.log.sandbox import LiveReplica

    raw = [(k, sid, i % 5, i % 4) for i, (k, sid) in enumerate(itertools.product(KINDS, SAMPLE_IDS[:3] + ["x"]))]
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples(_registry())
        log.append(_events(raw))
        replica = LiveReplica(log)
        want = sorted(map(str, log.query(f"SELECT * FROM {view}")[1]))
        for sql in (f"SELECT * FROM {view}", f"WITH v AS (SELECT * FROM {view.upper()}) SELECT * FROM v",
                    f"SELECT * FROM query_table('{view}')"):
            assert sorted(map(str, replica.query(sql)[1])) == want, sql
