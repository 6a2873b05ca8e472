"""The transient failure reasons (the environment's fault, not the sample's: the start they end is no attempt)
are one list, `builder.log.kinds.TRANSIENT_REASONS`: the Python fold and the plan read it, and the views call the
macro `is_transient(reason)` made from it (builder/log/schema.py); no SQL or Python spells the reasons out
anywhere else. Checked on the text of the schema and the code, on the macro a log holds, and on what the views
answer, reason by reason, with the fold checkpointed between a start and its failure or not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import duckdb
import numpy as np
import pytest

import builder
from builder.extract.source import Sample
from builder.log import fold as fold_module
from builder.log.events import Event, EventLog, detail, schema_dir
from builder.log.fold import fold
from builder.log.kinds import TRANSIENT_REASONS
from builder.log.schema import schema_digest
from builder.run import plan

# reasons a `failed` event may carry that are the sample's fault (or verify's finding): each start counts
OTHER_REASONS = ["error", "worker_died", "nonfinite", "too_long", "empty_sample", "token_out_of_range",
                 "token_mismatch", "bad_states", "too_big_for_volume", "interrupted_too_often", "checksum_mismatch",
                 "missing_data", "unreadable", "import_truncated"]


def test_no_sql_spells_out_the_transient_reasons():
    """The views name no transient reason: each place that asks calls `is_transient`."""
    for sql_file in schema_dir().glob("*.sql"):
        text = sql_file.read_text()
        for reason in TRANSIENT_REASONS - {"worker_lost"}:  # (worker_lost is an event kind too)
            assert f"'{reason}'" not in text, f"{sql_file.name} spells out '{reason}': call is_transient(reason)"
        lists = [m for m in re.findall(r"IN \(([^)]*)\)", text) if "'worker_lost'" in m]
        assert not lists, f"{sql_file.name} lists transient reasons: {lists}"
    views = (schema_dir() / "views.sql").read_text()
    assert len(re.findall(r"\bis_transient\(", views)) >= 3  # sample_fold, samples, runs
    assert TRANSIENT_REASONS is fold_module.TRANSIENT_REASONS  # the same list
    assert "is_transient(f.m_reason)" in plan.PLAN_SQL and "'worker_lost'" not in plan.PLAN_SQL  # the plan asks the macro


def test_no_python_module_spells_out_the_transient_reasons():
    """Only builder/log/kinds.py writes the three reasons down together; the rest import them."""
    pkg = Path(builder.__file__).resolve().parent
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Set | ast.List | ast.Tuple):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if TRANSIENT_REASONS <= names:
                    assert path == pkg / "log" / "kinds.py", f"{path}:{node.lineno} lists the transient reasons"


def test_the_macro_answers_exactly_the_transient_reasons(tmp_path):
    """The log's `is_transient` (a writer's, and the TEMP one a read-only open of an older log makes) says yes
    to exactly TRANSIENT_REASONS, and no to NULL."""
    path = tmp_path / "events.duckdb"
    with EventLog(path) as log:
        con = log.con
        for reason in [*TRANSIENT_REASONS, *OTHER_REASONS]:
            assert con.execute("SELECT is_transient(?)", [reason]).fetchone()[0] is (reason in TRANSIENT_REASONS)
        assert con.execute("SELECT is_transient(NULL)").fetchone()[0] is False
    con = duckdb.connect(str(path))
    con.execute("CREATE OR REPLACE MACRO is_transient(reason) AS false")  # an older version's list
    con.execute("UPDATE meta SET value = '\"older\"' WHERE key = 'schema_digest'")
    con.close()
    with EventLog(path, read_only=True) as log:
        answers = {r: log.query("SELECT is_transient(?)", [r])[1][0][0] for r in [*TRANSIENT_REASONS, "error"]}
    assert answers == {**{r: True for r in TRANSIENT_REASONS}, "error": False}


def test_the_schema_digest_covers_the_list(monkeypatch):
    """A change of the list is a change of the schema: an owner makes the views (and the macro) anew."""
    before = schema_digest()
    monkeypatch.setattr("builder.log.schema.TRANSIENT_REASONS", TRANSIENT_REASONS | {"error"})
    assert schema_digest() != before


@pytest.mark.parametrize("reason", sorted(TRANSIENT_REASONS) + OTHER_REASONS)
def test_a_start_counts_unless_a_transient_failure_ended_it(tmp_path, reason):
    """Sample a: started, failed(reason), then left in flight; b: the same, the fold checkpointed between its
    first start and that failure; c: an import's start then failed(reason) (an import start is kept apart as
    `imports` either way). The view and the Python fold agree, and say 1 + (reason is not transient)."""
    z = np.zeros(3, dtype=np.int32)
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples([Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate("abc")])

        def ev(kind, sid, **kw):
            return Event(kind, run_id="r", sample_id=sid, fingerprint="fp", attempt=1, **kw)

        log.append([ev("started", "a"), ev("failed", "a", reason=reason), ev("started", "a"), ev("started", "b")])
        log.checkpoint_fold()
        log.append([ev("failed", "b", reason=reason), ev("started", "b"),
                    ev("started", "c", detail=detail(origin="import")), ev("failed", "c", reason=reason)])
        counted = 1 + (reason not in TRANSIENT_REASONS)
        for _ in range(2):  # the checkpoint + tail, then the whole log in a new checkpoint
            rows = {r["sample_id"]: r for r in log.samples()}
            for sid, want in (("a", counted), ("b", counted), ("c", 1)):
                _, evs = log.query("SELECT seq, kind, reason, detail FROM events WHERE sample_id = ? ORDER BY seq",
                                   [sid])
                ref = fold(Event(k, sample_id=sid, seq=seq, reason=r, detail=d) for seq, k, r, d in evs)
                assert rows[sid]["attempts"] == ref.attempts == want, (sid, reason)
            imports = dict(log.query("SELECT sample_id, imports FROM sample_fold")[1])
            assert imports == {"a": 0, "b": 0, "c": 1}
            log.checkpoint_fold()


def test_progress_counts_a_sample_a_transient_failure_sent_back_as_pending(tmp_path):
    """`status` reads `progress`: a sample whose last word is a transient failure went back to pending (the run
    retries it, uncounted); it is neither `failed` nor in `failed_by_reason`, and `requeued` says how many."""
    z = np.zeros(3, dtype=np.int32)
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples([Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate("abcd")])

        def ev(kind, sid, **kw):
            return Event(kind, run_id="r", sample_id=sid, fingerprint="fp", attempt=1, **kw)

        log.append([ev("started", "a"), ev("failed", "a", reason="server_unavailable"),
                    ev("started", "b"), ev("failed", "b", reason="no_space"),
                    ev("started", "c"), ev("failed", "c", reason="nonfinite")])
        p = log.progress()
    assert (p["total"], p["pending"], p["requeued"], p["failed"]) == (4, 3, 2, 1)
    assert p["failed_by_reason"] == {"nonfinite": 1}
    assert p["remaining"] == 3
