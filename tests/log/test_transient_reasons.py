"""The transient failure reasons (the environment's fault, not the sample's: the start they end is no attempt)
are one list, `builder.log.fold.TRANSIENT_REASONS`, which schema/views.sql (`sample_fold`) spells out: the two
must not drift apart. Checked on the text of the view and on what it answers, reason by reason, with the fold
checkpointed between a start and its failure or not."""

from __future__ import annotations

import re

import numpy as np
import pytest

from builder.extract.source import Sample
from builder.log.events import Event, EventLog, detail, schema_dir
from builder.log.fold import TRANSIENT_REASONS, fold
from builder.run import plan

# reasons a `failed` event may carry that are the sample's fault (or verify's finding): each start counts
OTHER_REASONS = ["error", "worker_died", "nonfinite", "too_long", "empty_sample", "token_out_of_range",
                 "token_mismatch", "bad_states", "too_big_for_volume", "interrupted_too_often", "checksum_mismatch",
                 "missing_data", "unreadable", "import_truncated"]


def test_the_view_spells_out_exactly_the_transient_reasons():
    sql = (schema_dir() / "views.sql").read_text()
    lists = re.findall(r"kind = 'failed' AND coalesce\(reason IN \(([^)]*)\), false\) AS transient", sql)
    assert len(lists) == 1, "sample_fold must name the transient reasons in exactly one place"
    assert set(re.findall(r"'([^']*)'", lists[0])) == set(TRANSIENT_REASONS)
    # every other list of them (`progress` counts a sample failed for one of them as pending) is the same
    others = [m for m in re.findall(r"IN \(([^)]*)\)", sql) if "server_unavailable" in m]
    assert len(others) >= 2 and all(set(re.findall(r"'([^']*)'", m)) == set(TRANSIENT_REASONS) for m in others)
    assert plan.TRANSIENT_REASONS is TRANSIENT_REASONS  # the plan decides with the same list
    assert not set(OTHER_REASONS) & TRANSIENT_REASONS


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
