"""Replaying the log into a plan: what is done, what was interrupted, what failed, what is left to do."""

from __future__ import annotations

from dataclasses import dataclass, field

from builder.errors import SourceChangedError
from builder.extract.source import Sample
from builder.log.events import EventLog

# Failure reasons that say the stored bytes were damaged (verify); such samples are always re-extracted.
DAMAGE_REASONS = {"checksum_mismatch", "missing_data", "unreadable"}
# Failures of the environment, not of the sample; retried without counting against --max-attempts.
TRANSIENT_REASONS = {"no_space", "server_unavailable"}
# A dump file that could not be imported (`import_truncated`, ...): the sample is extracted by the next run.
IMPORT_PREFIX = "import_"
# A sample left `started` by runs that ended abruptly (crash, OOM kill, kill -9) is started again, until it
# has been started max_attempts + INTERRUPTED_EXTRA times (default 3 + 2 = 5): then it is given up
# (`failed`, reason `interrupted_too_often`), so a sample that takes the whole run down is not retried forever.
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
    pending: list[str] = field(default_factory=list)  # never started
    todo: list[Sample] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"total": self.total, "done": self.done, "interrupted": len(self.interrupted),
                "failed_retry": len(self.failed_retry), "failed_final": len(self.failed_final),
                "interrupted_final": len(self.interrupted_final),
                "damaged": len(self.damaged), "pending": len(self.pending), "todo": len(self.todo)}


def check_source(log: EventLog, samples: list[Sample]) -> int:
    """Refuse a source that changed under registered samples; register new ones. Returns how many were new."""
    known = log.registered()
    changed = [s.sample_id for s in samples if s.sample_id in known and known[s.sample_id][1] != s.fingerprint]
    current = {s.sample_id for s in samples}
    missing = [sid for sid in known if sid not in current]
    if changed or missing:
        parts = []
        if changed:
            parts.append(f"{len(changed)} sample(s) changed their tokens (e.g. id {', '.join(changed[:3])})")
        if missing:
            parts.append(f"{len(missing)} registered sample(s) are gone (e.g. id {', '.join(missing[:3])})")
        raise SourceChangedError(
            "source changed under the build: " + "; ".join(parts)
            + ". Restore the original source, or start a new build with `hsbuild init --force`"
        )
    return log.register_samples([s for s in samples if s.sample_id not in known])


def import_starts(log: EventLog) -> dict[str, int]:
    """Per sample, the `started` events of imports: reading a dump file is no extraction attempt."""
    _, rows = log.query("SELECT sample_id, count(*) FROM events WHERE kind = 'started' "
                        "AND json_extract_string(detail, '$.origin') = 'import' GROUP BY sample_id")
    return dict(rows)


def make_plan(log: EventLog, samples: list[Sample], max_attempts: int, limit: int | None = None) -> Plan:
    states = {r["sample_id"]: r for r in log.samples()}
    imported = import_starts(log)
    plan = Plan(total=len(samples))
    for s in samples:
        row = states.get(s.sample_id)
        state = row["state"] if row else "pending"
        plan.attempts[s.sample_id] = row["attempts"] if row else 0  # numbers the next attempt
        attempts = plan.attempts[s.sample_id] - imported.get(s.sample_id, 0)  # counted against max_attempts
        if state in ("written", "verified"):
            plan.done += 1
            continue
        if state == "started":
            if attempts >= max_attempts + INTERRUPTED_EXTRA:
                plan.interrupted_final.append(s.sample_id)
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
    if limit is not None:
        plan.todo = plan.todo[:limit]
    return plan
