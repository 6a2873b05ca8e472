"""`make_plan` was rewritten for logs of a million samples (one SQL fold for all samples, numpy for the sorting
out): on any log it returns exactly the Plan the previous per-sample Python replay returned, every field. That
replay is kept here as the reference."""

from __future__ import annotations

import datetime as dt
import itertools
import json

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.extract.samples import SourceSamples
from builder.extract.source import Sample
from builder.log.events import Event, EventLog
from builder.log.kinds import TRANSIENT_REASONS
from builder.run.plan import (
    DAMAGE_REASONS,
    IMPORT_PREFIX,
    INTERRUPTED_EXTRA,
    Plan,
    make_plan,
)


def reference_plan(log: EventLog, samples: list[Sample], max_attempts: int, limit: int | None = None) -> Plan:
    states = {r["sample_id"]: r for r in log.samples()}
    _, rows = log.query(
        "WITH resets AS (SELECT sample_id, max(seq) AS rseq FROM events WHERE kind = 'superseded' GROUP BY 1) "
        "SELECT e.sample_id, count(*) FROM events e LEFT JOIN resets r USING (sample_id) WHERE e.kind = 'started' "
        "AND json_extract_string(e.detail, '$.origin') = 'import' AND e.seq > coalesce(r.rseq, 0) GROUP BY 1")
    imported = dict(rows)
    plan = Plan(total=len(samples))
    for s in samples:
        row = states.get(s.sample_id)
        state = row["state"] if row else "pending"
        starts = row["starts"] if row else 0
        attempts = (row["attempts"] if row else 0) - imported.get(s.sample_id, 0)
        if state == "retired":
            plan.retired += 1
            continue
        if state in ("written", "verified"):
            plan.done += 1
            continue
        if state == "started":
            if attempts >= max_attempts + INTERRUPTED_EXTRA:
                plan.interrupted_final.append(s.sample_id)
                plan.attempts[s.sample_id] = starts
                continue
            plan.interrupted.append(s.sample_id)
        elif state == "failed":
            reason = row["error"]
            if reason in DAMAGE_REASONS:
                plan.damaged.append(s.sample_id)
            elif reason in TRANSIENT_REASONS or reason.startswith(IMPORT_PREFIX) or attempts < max_attempts:
                plan.failed_retry.append(s.sample_id)
            else:
                plan.failed_final.append(s.sample_id)
                continue
        else:
            plan.pending.append(s.sample_id)
        plan.todo.append(s)
        plan.attempts[s.sample_id] = starts
    plan.total -= plan.retired
    if limit is not None:
        plan.todo = plan.todo[:limit]
    return plan


IDS = [f"s{i}" for i in range(6)]
REGISTERED = IDS[:5]  # s5 is in the source list but never registered
REASONS = ["nonfinite", "checksum_mismatch", "no_space", "import_truncated", "server_unavailable", "missing_data"]

raw_event = st.tuples(
    st.sampled_from(["started", "started", "started", "written", "verified", "failed", "failed", "superseded",
                     "retired", "row_moved"]),
    st.sampled_from(IDS),
    st.integers(0, len(REASONS) - 1),
    st.booleans(),  # a start by an import
)


def _events(raw) -> list[Event]:
    out = []
    for kind, sid, r, imported in raw:
        ev = Event(kind, run_id="r", sample_id=sid, ts=dt.datetime(2026, 1, 1))
        if kind == "started" and imported:
            ev.detail = json.dumps({"origin": "import"})
        elif kind == "started" and r == 0:
            ev.detail = json.dumps({"origin": "run"})
        if kind == "written":
            ev.segment, ev.token_start, ev.num_tokens, ev.nbytes = "seg", 0, 7, 70
        if kind == "failed":
            ev.reason = REASONS[r]
        if kind == "retired":
            ev.reason = "skipped"
        out.append(ev)
    return out


def _samples(order: list[int]) -> list[Sample]:
    z = np.zeros(3, dtype=np.int32)
    return [Sample(IDS[i], row, z, z.astype(np.uint8), "fp") for row, i in enumerate(order)]


def _columnar(order: list[int]) -> SourceSamples:
    """`_samples(order)` as a run holds a source: columns, no object a sample."""
    n = len(order)
    return SourceSamples(pa.array([IDS[i] for i in order], pa.string()), pa.array(["fp"] * n, pa.string()),
                         np.arange(n), np.arange(n) * 3, np.full(n, 3), np.zeros(3 * n, np.int32),
                         np.zeros(3 * n, np.uint8))


def _attempts_without_imports(log: EventLog) -> dict[str, int]:
    """Per sample with events: its `started` events after its last `superseded`, imports left out, and less each
    extraction start that a transient failure ended (the sample's next event of the fold's kinds, verified and
    row_moved aside, is a `failed` for a transient reason), counted event by event in Python."""
    _, rows = log.query("SELECT sample_id, kind, detail, reason FROM events WHERE sample_id IS NOT NULL ORDER BY seq")
    out: dict[str, int] = {}
    before: dict[str, str] = {}  # the sample's previous event: 'extraction' for a start that is not an import's
    for sid, kind, det, reason in rows:
        n = out.setdefault(sid, 0)
        if kind in ("verified", "row_moved"):
            continue
        extraction = kind == "started" and not (det and json.loads(det).get("origin") == "import")
        if kind == "superseded":
            out[sid] = 0
        elif extraction:
            out[sid] = n + 1
        elif kind == "failed" and reason in TRANSIENT_REASONS and before.get(sid) == "extraction":
            out[sid] = n - 1  # no attempt: the environment's fault
        before[sid] = "extraction" if extraction else kind
    return out


def _fields(p: Plan) -> dict:
    d = dict(vars(p))
    d["todo"] = [(s.sample_id, s.row) for s in p.todo]
    return d


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.lists(raw_event, max_size=30),
       order=st.permutations(range(len(IDS))).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: list(p[k:]))),
       max_attempts=st.integers(1, 3),
       limit=st.one_of(st.none(), st.integers(-2, 4)),
       cuts=st.lists(st.booleans(), min_size=1, max_size=8))
def test_make_plan_equals_the_reference_replay(tmp_path_factory, raw, order, max_attempts, limit, cuts):
    """...with the fold checkpointed after arbitrary batches: the plan reads the checkpoint and the tail (import
    starts kept apart in both), the reference every event."""
    path = tmp_path_factory.mktemp("plan") / "events.duckdb"
    with EventLog(path) as log:
        log.register_samples([s for s in _samples(list(range(len(IDS)))) if s.sample_id in REGISTERED])
        for k, (_, batch) in enumerate(itertools.groupby(enumerate(_events(raw)), key=lambda p: p[0] // 4)):
            log.append([e for _, e in batch])
            if cuts[k % len(cuts)]:
                log.checkpoint_fold()
        samples = _samples(order)  # a subset of the source, in any order (a registered sample may be gone)
        got, want = make_plan(log, samples, max_attempts, limit), reference_plan(log, samples, max_attempts, limit)
        assert _fields(got) == _fields(want)
        assert _fields(make_plan(log, _columnar(order), max_attempts, limit)) == _fields(want)
        # the count the plan's decisions rest on, for every sample (a plan shows it only near a limit): the
        # attempts since the last restart, without the starts of imports, as the checkpoint and tail combine it
        _, rows = log.query("SELECT sample_id, attempts - imports FROM sample_fold")
        assert dict(rows) == _attempts_without_imports(log)
        given = {id(s) for s in samples}
        assert all(id(s) in given for s in got.todo)  # the caller's own Sample objects


def test_an_empty_source_plans_nothing(tmp_path):
    with EventLog(tmp_path / "events.duckdb") as log:
        assert _fields(make_plan(log, [], 3)) == _fields(Plan())


def test_interrupted_limits_count_attempts_since_the_restart_and_without_imports(tmp_path):
    """The cases the random logs reach rarely: a sample started often but restarted (`superseded`) or imported
    in between is not given up; one started often since is."""
    raw = ([("started", "s0", 1, False)] * 3 + [("superseded", "s0", 1, False)] + [("started", "s0", 1, False)] * 2
           + [("started", "s1", 1, True)] * 2 + [("started", "s1", 1, False)] * 2
           + [("started", "s2", 1, False)] * 3
           + [("started", "s3", 1, False), ("failed", "s3", 0, False), ("started", "s3", 1, True),
              ("failed", "s3", 0, False)])
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples(_samples(list(range(len(IDS))))[:5])
        log.append(_events(raw))
        samples = _samples(list(range(len(IDS))))
        got, want = make_plan(log, samples, 1), reference_plan(log, samples, 1)
        assert _fields(got) == _fields(want)
        assert got.interrupted == ["s0", "s1"] and got.interrupted_final == ["s2"]
        assert got.failed_final == ["s3"] and got.attempts["s0"] == 5


def test_a_run_checkpoints_the_fold_and_no_answer_changes(make_build, monkeypatch):
    """A real run, with the checkpoint threshold lowered so that the coordinator checkpoints the fold during the
    run and at its end (schema/events.sql, `fold_checkpoint`): every state, and the plan of a resume, are those
    of the whole log folded (the checkpoint emptied), and a resume after it finds nothing to do."""
    import builder.log.events as events_mod
    from builder.layout import layout
    from builder.run.coordinator import RunOptions, run_build

    monkeypatch.setattr(events_mod, "FOLD_CHECKPOINT_EVENTS", 7)
    build = make_build(12)
    assert run_build(build, RunOptions(workers=1, limit=9), echo=lambda m: None).written == 9
    with EventLog(layout(build).events) as log:
        assert log.query("SELECT count(*) FROM fold_checkpoint_mark WHERE upto > 0")[1][0][0] == 1
        assert log.fold_tail() < 7
        checkpointed = sorted(log.query("SELECT * FROM samples")[1])
        log.con.execute("DELETE FROM fold_checkpoint; DELETE FROM fold_checkpoint_mark")
        log._fold_upto = 0
        assert sorted(log.query("SELECT * FROM samples")[1]) == checkpointed
        monkeypatch.setattr(events_mod, "FOLD_CHECKPOINT_EVENTS", 10**9)  # this close leaves it emptied
    assert sum(1 for r in checkpointed if r[3] == "written") == 9
    monkeypatch.setattr(events_mod, "FOLD_CHECKPOINT_EVENTS", 7)
    again = run_build(build, RunOptions(workers=1), resume=True, echo=lambda m: None)
    assert again.written == 3 and again.plan.done == 9
