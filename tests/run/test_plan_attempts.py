"""Issue 28 (point 5): a start that a transient failure ended (`server_unavailable`, `no_space`, `worker_lost`:
the environment's fault, not the sample's) is no attempt. It counts neither against --max-attempts nor toward
the limit on interrupted starts (--max-attempts + INTERRUPTED_EXTRA), in the plan of a resume, in the fold (the
`samples` view and `builder.log.fold.fold`), with or without the fold checkpointed between a start and its
failure. The attempt numbers the plan hands out still count every start (unique and increasing per sample).

The logs are real event logs of real builds, written as a `--backend vllm` run writes them while its server is
down (each cycle: `started`, then `failed` with reason `server_unavailable`)."""

from __future__ import annotations

from builder.config import BuildConfig
from builder.extract.source import load_source
from builder.layout import layout
from builder.log.events import Event, EventLog, detail
from builder.log.fold import fold
from builder.log.kinds import TRANSIENT_REASONS
from builder.run.coordinator import RunOptions, run_build
from builder.run.plan import INTERRUPTED_EXTRA, make_plan

MAX_ATTEMPTS = 3


class _Writer:
    """Appends one sample's events as runs of a build would, numbering its attempts as a run does."""

    def __init__(self, log: EventLog, sample_id: str):
        self.log, self.sid = log, sample_id
        self.fp = log.query("SELECT fingerprint FROM source_samples WHERE sample_id = ?", [sample_id])[1][0][0]
        self.n = 0
        self.runs = 0

    def run_started(self) -> str:
        self.runs += 1
        run = f"{self.sid}-run{self.runs}"
        self.log.append([Event("run_started", run_id=run, detail=detail(workers=1, backend="vllm"))])
        return run

    def start(self, run: str) -> None:
        self.n += 1
        self.log.append([Event("started", run_id=run, sample_id=self.sid, fingerprint=self.fp, attempt=self.n,
                               worker=0)])

    def fail(self, run: str, reason: str) -> None:
        self.log.append([Event("failed", run_id=run, sample_id=self.sid, fingerprint=self.fp, attempt=self.n,
                               worker=0, reason=reason, detail=detail(message=f"test: {reason}"))])

    def cycles(self, run: str, k: int, reasons=("server_unavailable",)) -> None:
        for i in range(k):
            self.start(run)
            self.fail(run, reasons[i % len(reasons)])


def _samples(build):
    return load_source(BuildConfig.from_toml(layout(build).config).source)


def _attempts(log: EventLog, sid: str) -> tuple[int, int]:
    """(the `samples` view's attempts, the Python fold's over the sample's events in the log)."""
    view = log.samples("WHERE sample_id = ?", [sid])[0]["attempts"]
    _, rows = log.query("SELECT seq, kind, reason, detail FROM events WHERE sample_id = ? ORDER BY seq", [sid])
    ref = fold(Event(kind, sample_id=sid, seq=seq, reason=reason, detail=det) for seq, kind, reason, det in rows)
    return view, ref.attempts


def _written_attempts(build, sid: str) -> list[int]:
    with EventLog(layout(build).events, read_only=True) as log:
        return [r[0] for r in log.query("SELECT attempt FROM events WHERE sample_id = ? AND kind = 'written'",
                                        [sid])[1]]


def test_transient_cycles_then_a_crash_leave_the_sample_retryable(make_build):
    """100 starts that the server being down ended, then one left in flight by a crash: one counted attempt,
    so the next run extracts the sample (before the fix: 101 attempts >= 3 + 2, given up for good as
    `interrupted_too_often`)."""
    build = make_build(4, seed=5)
    with EventLog(layout(build).events) as log:
        w = _Writer(log, "s0001")
        run = w.run_started()
        w.cycles(run, 50)
        w.start(run)
        log.checkpoint_fold()  # the fold checkpointed between a start and the failure that ends it
        w.fail(run, "server_unavailable")
        w.cycles(run, 49)
        w.start(w.run_started())  # this run crashed with the sample in flight
        assert w.n == 101
        for fresh in (False, True):  # the checkpoint + tail, then everything in a new checkpoint
            if fresh:
                log.checkpoint_fold()
            assert _attempts(log, "s0001") == (1, 1)
            plan = make_plan(log, _samples(build), MAX_ATTEMPTS)
            assert plan.interrupted == ["s0001"] and plan.interrupted_final == []
            assert "s0001" in [s.sample_id for s in plan.todo]
            assert plan.attempts["s0001"] == 101  # every start: the next attempt is numbered 102
    report = run_build(build, RunOptions(workers=1, max_attempts=MAX_ATTEMPTS), echo=lambda m: None)
    assert report.plan.interrupted_final == [] and report.written == 4
    assert _written_attempts(build, "s0001") == [102]
    with EventLog(layout(build).events, read_only=True) as log:
        row = log.samples("WHERE sample_id = 's0001'")[0]
        assert (row["state"], row["attempts"], row["starts"]) == ("written", 2, 102)


def test_crashes_still_count_toward_the_interrupted_limit(make_build):
    """Transient cycles in between change nothing for the starts that crashes left in flight: at
    --max-attempts + INTERRUPTED_EXTRA of them the sample is given up."""
    build = make_build(3, seed=6)
    with EventLog(layout(build).events) as log:
        w = _Writer(log, "s0001")
        for _ in range(MAX_ATTEMPTS + INTERRUPTED_EXTRA):
            run = w.run_started()
            w.cycles(run, 20, sorted(TRANSIENT_REASONS))
            w.start(w.run_started())  # left in flight by a crash
        assert _attempts(log, "s0001") == (MAX_ATTEMPTS + INTERRUPTED_EXTRA,) * 2
        plan = make_plan(log, _samples(build), MAX_ATTEMPTS)
        assert plan.interrupted_final == ["s0001"] and plan.interrupted == []
        assert plan.attempts["s0001"] == w.n


def test_transient_cycles_do_not_use_up_max_attempts(make_build):
    """100 transient cycles and 2 real failures (`error`): retried with --max-attempts 3, and the next run
    extracts it; after 3 real failures: final (before the fix both were final, at 102 and 103 attempts)."""
    build = make_build(4, seed=8)
    with EventLog(layout(build).events) as log:
        two, three = _Writer(log, "s0001"), _Writer(log, "s0002")
        for w, real in ((two, 2), (three, 3)):
            run = w.run_started()
            w.cycles(run, 100)
            for _ in range(real):
                w.start(run)
                w.fail(run, "error")
        assert _attempts(log, "s0001") == (2, 2) and _attempts(log, "s0002") == (3, 3)
        plan = make_plan(log, _samples(build), MAX_ATTEMPTS)
        assert plan.failed_retry == ["s0001"] and plan.failed_final == ["s0002"]
        assert (plan.attempts["s0001"], "s0002" in plan.attempts) == (102, False)
    report = run_build(build, RunOptions(workers=1, max_attempts=MAX_ATTEMPTS), echo=lambda m: None)
    assert report.written == 3  # s0001 retried, s0002 not
    assert _written_attempts(build, "s0001") == [103] and _written_attempts(build, "s0002") == []


def test_real_failures_between_transient_cycles_are_counted(make_build):
    """Real failures interleaved with transient cycles (every transient reason): only the real ones count; a
    sample whose last word is a transient failure is pending (not failed), retried whatever its count."""
    build = make_build(4, seed=7)
    with EventLog(layout(build).events) as log:
        two, three = _Writer(log, "s0001"), _Writer(log, "s0002")
        for w, real in ((two, 2), (three, 3)):
            run = w.run_started()
            w.cycles(run, 60, sorted(TRANSIENT_REASONS))
            for _ in range(real):
                w.start(run)
                w.fail(run, "error")
                w.cycles(run, 20, sorted(TRANSIENT_REASONS))
        assert _attempts(log, "s0001") == (2, 2) and _attempts(log, "s0002") == (3, 3)
        plan = make_plan(log, _samples(build), MAX_ATTEMPTS)
        assert plan.pending == ["s0000", "s0001", "s0002", "s0003"]  # (s0000 and s0003: never started)
        assert plan.failed_retry == plan.failed_final == []
        assert {r["state"] for r in log.samples("WHERE sample_id IN ('s0001', 's0002')")} == {"pending"}
        for w in (two, three):  # one more real failure each
            w.start(run := w.run_started())
            w.fail(run, "error")
        assert _attempts(log, "s0001") == (3, 3) and _attempts(log, "s0002") == (4, 4)
        plan = make_plan(log, _samples(build), MAX_ATTEMPTS)
        assert plan.failed_retry == [] and plan.failed_final == ["s0001", "s0002"]
