"""Replaying the log into a plan: what is done, what was interrupted, what failed, what is left to do."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa

from builder.errors import QueryError
from builder.extract.source import Sample
from builder.log.events import EventLog

# Failure reasons that say the stored bytes were damaged (verify); such samples are always re-extracted.
DAMAGE_REASONS = {"checksum_mismatch", "missing_data", "unreadable"}
# The transient reasons (builder/log/kinds.py TRANSIENT_REASONS, the views' macro `is_transient`): failures of the environment, not of the sample (worker_lost: a Ray
# node or actor gone); such a sample is pending again (the `samples` view's state), and the start they end
# counts neither against --max-attempts nor toward the interrupted limit below (the fold leaves it out of
# `attempts`).
# A dump file that could not be imported (`import_truncated`, ...): the sample is extracted by the next run.
IMPORT_PREFIX = "import_"
# A sample left `started` by runs that ended abruptly (crash, OOM kill, kill -9) is started again, until it
# has max_attempts + INTERRUPTED_EXTRA counted attempts (default 3 + 2 = 5; starts that a transient failure
# ended, and imports, are none): then it is given up (`failed`, reason `interrupted_too_often`), so a sample
# that takes the whole run down is not retried forever.
INTERRUPTED_EXTRA = 2


@dataclass
class Plan:
    total: int = 0
    done: int = 0
    interrupted: list[str] = field(default_factory=list)  # left `started` by a crash
    failed_retry: list[str] = field(default_factory=list)  # failed, retried now
    failed_final: list[str] = field(default_factory=list)  # failed max_attempts times; not retried
    interrupted_final: list[str] = field(default_factory=list)  # left `started` too often; given up now
    damaged: list[str] = field(default_factory=list)  # marked damaged by verify; re-extracted
    retired: int = 0  # removed from the source or skipped: not extracted
    pending: list[str] = field(default_factory=list)  # never started, or sent back by a transient failure
    todo: list[Sample] = field(default_factory=list)
    # starts so far, every one (transient and import starts too), of each sample to extract (todo, before
    # --limit) or given up now: numbers its next attempt (`attempt` = this + 1, unique and increasing per
    # sample). Not what --max-attempts counts: that is the fold's `attempts` less `imports`.
    attempts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"total": self.total, "done": self.done, "interrupted": len(self.interrupted),
                "failed_retry": len(self.failed_retry), "failed_final": len(self.failed_final),
                "interrupted_final": len(self.interrupted_final),
                "damaged": len(self.damaged), "pending": len(self.pending), "todo": len(self.todo),
                "retired": self.retired}


# The samples' states as small codes (the plan reads a million rows as numpy arrays, not as dicts). Read from
# `sample_fold` directly, not through `samples`: a semi-join with source_samples (which the view's join amounts
# to: only registered samples have a state) costs less than that view's join (0.5 s instead of 0.8 at a million
# samples). The codes follow the `samples` view's state rule (schema/views.sql), written and verified both DONE.
# Attempts leave out the starts of imports (reading a dump file is no extraction attempt), which the fold keeps
# apart (`imports`), and the starts a transient failure ended (the fold's `attempts` has none), so the plan
# reads no event but the fold's tail. tests/run/test_scale_plan.py checks the plan
# against a replay of the `samples` view and of the events.
PENDING, DONE, RETIRED, STARTED, FAILED = range(5)
PLAN_SQL = f"""
SELECT p.pos,
       CASE f.mkind WHEN 'written' THEN {DONE} WHEN 'retired' THEN {RETIRED} WHEN 'started' THEN {STARTED}
                    WHEN 'failed' THEN CASE WHEN is_transient(f.m_reason) THEN {PENDING} ELSE {FAILED} END
                    ELSE {PENDING} END::TINYINT AS code,
       coalesce(f.starts, 0)::BIGINT AS starts,
       (coalesce(f.attempts, 0) - coalesce(f.imports, 0))::BIGINT AS attempts,
       CASE WHEN f.mkind = 'failed' THEN f.m_reason END AS error
FROM _plan_samples p
LEFT JOIN (SELECT * FROM sample_fold WHERE sample_id IN (SELECT sample_id FROM source_samples)) f
       ON f.sample_id = p.sample_id
"""


@contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic GC paused: planning a million samples allocates millions of small objects, and each
    collection would walk every live Sample of the source (0.4 s of a 1.3 s plan at a million samples)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def make_plan(log: EventLog, samples: list[Sample], max_attempts: int, limit: int | None = None) -> Plan:
    """Replay the log for these source samples (in their order). One query folds the log (the `samples`
    view's fold) for all of them at once; only the samples left to do are looked at one by one."""
    with _no_gc():
        return _make_plan(log, samples, max_attempts, limit)


def _make_plan(log: EventLog, samples: list[Sample], max_attempts: int, limit: int | None) -> Plan:
    columns = getattr(samples, "registry_columns", None)  # a source's columnar samples: no object a sample
    sid = columns()["sample_id"] if columns is not None else pa.array([s.sample_id for s in samples], pa.string())
    plan = Plan(total=len(samples))
    if not len(sid):
        return plan

    def ids(at) -> list[str]:
        """The sample ids at these positions."""
        at = np.asarray(at, dtype=np.int64)
        return sid.take(pa.array(at)).to_pylist() if at.size else []

    table = pa.table({"sample_id": sid, "pos": pa.array(np.arange(len(sid)), pa.int64())})
    cur = log.con.cursor()
    try:
        cur.register("_plan_samples", table)
        res = cur.sql(PLAN_SQL).to_arrow_table()
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from e
    finally:
        cur.close()
    # rows come back in any order: put them in the samples' (no sort in SQL)
    pos = res.column("pos").to_numpy()
    code, starts, attempts = (np.empty(len(sid), np.int64) for _ in range(3))
    code[pos] = res.column("code").to_numpy()
    starts[pos] = res.column("starts").to_numpy()
    attempts[pos] = res.column("attempts").to_numpy()
    failed_rows = np.flatnonzero(res.column("code").to_numpy() == FAILED)
    failed_at = pos[failed_rows]
    order = np.argsort(failed_at, kind="stable")
    failed_at = failed_at[order]
    errors = res.column("error").take(pa.array(failed_rows[order])).to_pylist() if failed_rows.size else []
    plan.done = int(np.count_nonzero(code == DONE))
    plan.retired = int(np.count_nonzero(code == RETIRED))
    # counted against max_attempts: the extraction attempts since the sample last started over
    started = code == STARTED
    given_up = started & (attempts >= max_attempts + INTERRUPTED_EXTRA)
    todo = (code == PENDING) | (started & ~given_up)
    damaged, retry, final = [], [], []
    if failed_at.size:
        for i, reason, n in zip(failed_at.tolist(), errors, attempts[failed_at].tolist(), strict=True):
            if reason in DAMAGE_REASONS:
                damaged.append(i)
            elif reason.startswith(IMPORT_PREFIX) or n < max_attempts:
                retry.append(i)
            else:
                final.append(i)
        todo[damaged + retry] = True
    plan.interrupted = ids(np.flatnonzero(started & ~given_up))
    plan.interrupted_final = ids(np.flatnonzero(given_up))
    plan.failed_retry = ids(retry)
    plan.failed_final = ids(final)
    plan.damaged = ids(damaged)
    plan.pending = ids(np.flatnonzero(code == PENDING))
    todo_at = np.flatnonzero(todo)
    counted = np.flatnonzero(todo | given_up)  # (not a dict of every sample: a million of them cost 0.2 s)
    plan.attempts = dict(zip(ids(counted), starts[counted].tolist(), strict=True))
    if limit is not None:
        todo_at = todo_at[:limit]
    at = getattr(samples, "at", None)  # a source's columnar samples make them in bulk
    plan.todo = at(todo_at) if at is not None else [samples[i] for i in todo_at.tolist()]
    plan.total -= plan.retired
    return plan
