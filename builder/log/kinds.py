"""The event log's vocabulary, in one place: the kinds of event (`EventKind`) and the failure reasons that are
the environment's fault, not the sample's (`TRANSIENT_REASONS`).

schema/events.sql's comment on `events.kind` and docs/design.md section 3 list exactly `EventKind`
(tests/log/test_event_kinds.py); an `Event` of any other kind is refused where it is made. The views take
`TRANSIENT_REASONS` from here: builder/log/schema.py writes it into the `is_transient(reason)` macro they call
(tests/log/test_transient_reasons.py)."""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    """Every kind of event hsbuild writes. A member is its string (`EventKind.STARTED == "started"`), which is
    what the log stores."""

    # a sample's: the fold's main events (docs/design.md section 3), then a check of its bytes that could not run
    STARTED = "started"
    WRITTEN = "written"
    VERIFIED = "verified"
    FAILED = "failed"
    CHECK_ERROR = "check_error"
    # a sample's source row (section 3.1)
    SUPERSEDED = "superseded"
    RETIRED = "retired"
    ROW_MOVED = "row_moved"
    # a build's or a run's
    INIT = "init"
    RUN_STARTED = "run_started"
    RUN_FINISHED = "run_finished"
    SEGMENT_SEALED = "segment_sealed"
    PAUSED = "paused"
    RESUMED = "resumed"
    STALLED = "stalled"
    UNSTALLED = "unstalled"
    ADOPTED = "adopted"
    ENGINE_PROBE = "engine_probe"
    ENGINE_REFUSED = "engine_refused"
    SOURCE_CHANGED = "source_changed"
    SOURCE_MOVED = "source_moved"
    VERIFY_STARTED = "verify_started"
    VERIFY_FINISHED = "verify_finished"
    DOCTOR = "doctor"
    GPU_STATS = "gpu_stats"
    GC = "gc"
    EXPORT = "export"
    IMPORT = "import"
    LOG_REBUILT = "log_rebuilt"
    # a --ray run's
    NODES_PROBED = "nodes_probed"
    WORKER_PLACED = "worker_placed"
    WORKER_LOST = "worker_lost"


# Failures of the environment, not of the sample (a full volume, an inference server down, a Ray node or actor
# gone): the start they end is no attempt, so it never counts against --max-attempts nor toward the limit on
# interrupted starts (builder/run/plan.py), and a sample whose last word is one is pending, not failed. The one
# list: the fold (builder/log/fold.py) reads it, the views call the macro `is_transient(reason)` made from it.
TRANSIENT_REASONS = frozenset({"no_space", "server_unavailable", "worker_lost"})
