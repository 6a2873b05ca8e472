"""`run --verify-after-write`: a check that cannot read the sample back (EIO, EMFILE, ...) is retried, then
reported as a `check_error` (the sample stays written, no attempt counted), never `failed`; only evidence about
the bytes (a checksum mismatch) fails a sample. docs/design.md section 9.

The workers are spawned processes: the read errors are injected into them by a `sitecustomize` module on their
PYTHONPATH that wraps `builder.store.readback.check_sample` (what the worker's check calls), keyed by the
sample's place in its segment: nothing in hsbuild knows it is being tested."""

from __future__ import annotations

import datetime as dt
import json
import os
import textwrap
from pathlib import Path

import numpy as np

from builder.extract.source import Sample
from builder.layout import layout
from builder.log.events import COLUMNS, Event, EventLog
from builder.log.fold import fold
from builder.run.coordinator import RunOptions, run_build
from builder.store.readback import RETRIES
from builder.verify.sweep import SweepOptions, run_sweep

N = 12

SITECUSTOMIZE = textwrap.dedent('''
    """Test-only: read faults in the --verify-after-write check (tests/run/test_verify_after_write.py)."""
    import errno, json, os, threading
    _plan = os.environ.get("HSBUILD_TEST_CHECK_FAULTS")
    if _plan:
        from builder.store import readback as _checks
        _faults, _seen, _lock, _real = json.loads(_plan), {}, threading.Lock(), _checks.check_sample

        def _check_sample(data_root, segment, token_start, *a, **k):
            # the n-th sample checked (by its place in its segment) gets the n-th fault: "eio" (every read
            # fails), an int k (the first k reads fail), "mismatch" (a checksum mismatch); past the list, none
            with _lock:
                seen = _seen.setdefault((segment, token_start), [len(_seen), 0])
                seen[1] += 1
                i, calls = seen
            fault = _faults[i] if i < len(_faults) else None
            if fault == "eio" or (isinstance(fault, int) and calls <= fault):
                raise OSError(errno.EIO, "Input/output error (injected)", str(data_root / segment))
            if fault == "mismatch":
                return _checks.SampleCheck((_checks.MISMATCH, "checksum mismatch in hidden_state (injected)"))
            return _real(data_root, segment, token_start, *a, **k)

        _checks.check_sample = _check_sample
''')


def inject_check_faults(monkeypatch, tmp_path: Path, faults: list) -> None:
    """Spawned workers started from now on get `faults` (see SITECUSTOMIZE); their commits one group at a time,
    so the samples are checked in the order of their place in the segment."""
    d = tmp_path / "inject"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("HSBUILD_TEST_CHECK_FAULTS", json.dumps(faults))
    monkeypatch.setenv("HSBUILD_COMMITS_IN_FLIGHT", "1")
    monkeypatch.setenv("HSBUILD_GROUP_SECONDS", "5")  # groups of several samples: the rest of a group matters


def all_events(build: Path) -> list[Event]:
    with EventLog(layout(build).events, read_only=True) as log:
        rows = log.query_dicts(f"SELECT {', '.join(COLUMNS)} FROM events ORDER BY seq")
    return [Event(**r) for r in rows]


def samples(build: Path) -> dict[str, dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return {r["sample_id"]: r for r in log.samples()}


def assert_view_is_the_fold(build: Path) -> None:
    """The `samples` view agrees with the Python fold (builder.log.fold) on every sample of this real log."""
    evs = all_events(build)
    for sid, r in samples(build).items():
        ref = fold([e for e in evs if e.sample_id == sid])
        got = (r["state"], r["attempts"], r["segment"], r["token_start"], r["num_tokens"], r["error"],
               r["retired_reason"])
        assert got == ref.as_tuple(), (sid, [(e.seq, e.kind) for e in evs if e.sample_id == sid])


def test_a_read_error_in_the_check_is_a_check_error_never_a_failure(make_build, tmp_path, monkeypatch):
    """The first sample checked cannot be read back at all (EIO on every try), the second fails once and reads on
    the retry, the third reads back wrong. The first stays `written` with a `check_error` event (no attempt
    counted, the rest of its group unharmed), the second is verified, only the third is `failed`; the next run
    extracts nothing again and a later `hsbuild verify` finds everything good."""
    build = make_build(n=N)
    inject_check_faults(monkeypatch, tmp_path, ["eio", 1, "mismatch"])
    said: list[str] = []
    rep = run_build(build, RunOptions(workers=1, verify_after_write=True), echo=said.append)
    assert (rep.written, rep.failed, rep.check_errors) == (N - 1, 1, 1), said

    evs = all_events(build)
    written = sorted((e for e in evs if e.kind == "written"), key=lambda e: e.token_start)
    assert len({e.segment for e in written}) == 1 and written[0].token_start == 0
    unread, retried = written[0].sample_id, written[1].sample_id
    failed = [e for e in evs if e.kind == "failed"]
    assert [e.reason for e in failed] == ["checksum_mismatch"], [(e.sample_id, e.reason, e.detail) for e in failed]
    mismatched = failed[0].sample_id
    errs = [e for e in evs if e.kind == "check_error"]
    assert [e.sample_id for e in errs] == [unread]
    d = json.loads(errs[0].detail)
    assert d["mode"] == "after_write" and "EIO" in d["message"] and f"({RETRIES + 1} tries)" in d["message"], d
    assert errs[0].reason == "check_error" and errs[0].segment == written[0].segment and errs[0].token_start == 0

    rows = samples(build)
    assert rows[unread]["state"] == "written" and rows[unread]["attempts"] == 1 and rows[unread]["error"] is None
    assert rows[retried]["state"] == "verified"
    assert rows[mismatched]["state"] == "failed" and rows[mismatched]["error"] == "checksum_mismatch"
    others = set(rows) - {unread, mismatched}
    assert {rows[s]["state"] for s in others} == {"verified"}
    assert_view_is_the_fold(build)
    assert any("1 sample(s) written but not checked" in m and "hsbuild verify" in m for m in said), said
    finished = next(e for e in reversed(evs) if e.kind == "run_finished")
    assert json.loads(finished.detail)["check_errors"] == 1

    # the faults gone: the next run redoes nothing written (the unread sample is not extracted again); the
    # mismatched one it adopts from its group's manifest after reading it back (design.md section 11: its bytes
    # are good, the mismatch was injected); verify finds every sample good
    monkeypatch.delenv("HSBUILD_TEST_CHECK_FAULTS")
    said.clear()
    rep = run_build(build, RunOptions(workers=1), echo=said.append)
    assert (rep.outcome, rep.exit_code, rep.failed) == ("completed", 0, 0), said
    assert [e.sample_id for e in all_events(build) if e.kind == "started"].count(unread) == 1  # never redone
    assert samples(build)[mismatched]["state"] in ("written", "verified")
    s = run_sweep(build, SweepOptions(), echo=lambda m: None)
    assert (s.outcome, s.ok, s.check_errors, s.exit_code) == ("completed", N, 0, 0)
    assert {r["state"] for r in samples(build).values()} == {"verified"}
    assert_view_is_the_fold(build)


def test_a_check_error_event_changes_no_state_in_the_view_or_the_fold(tmp_path):
    """`check_error` is no main event: after a `written` the sample stays written (a later `verified` still
    verifies it), across a checkpoint of the fold too; the view and the Python fold agree."""
    ids = ["a", "b", "c"]
    z = np.zeros(5, dtype=np.int32)
    t0 = dt.datetime(2024, 1, 1)

    def ev(kind, sid, **kw):
        return Event(kind, run_id="r", sample_id=sid, attempt=1, ts=t0, **kw)

    loc = {"segment": "seg-1", "token_start": 0, "num_tokens": 5}
    batches = [
        [ev("started", "a"), ev("written", "a", **loc), ev("check_error", "a", reason="check_error", **loc)],
        [ev("started", "b"), ev("written", "b", **loc), ev("check_error", "b", reason="check_error", **loc),
         ev("verified", "b", **loc)],
        [ev("started", "c"), ev("written", "c", **loc)],
        [ev("check_error", "c", reason="check_error", **loc)],  # alone after a checkpoint
    ]
    with EventLog(tmp_path / "events.duckdb") as log:
        log.register_samples([Sample(sid, i, z, z.astype(np.uint8), "fp") for i, sid in enumerate(ids)])
        for batch in batches:
            log.append(batch)
            log.checkpoint_fold()
        rows = {r["sample_id"]: r for r in log.samples()}
    evs = [e for b in batches for e in b]
    for sid in ids:
        ref = fold([e for e in evs if e.sample_id == sid])
        r = rows[sid]
        assert (r["state"], r["attempts"], r["segment"], r["token_start"], r["num_tokens"], r["error"],
                r["retired_reason"]) == ref.as_tuple(), sid
    assert {sid: rows[sid]["state"] for sid in ids} == {"a": "written", "b": "verified", "c": "written"}
    assert all(rows[sid]["attempts"] == 1 for sid in ids)
