"""Replaying the log into a plan: what is done, what was interrupted, what failed, what is left to do."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    retired: int = 0  # removed from the source or skipped: not extracted
    pending: list[str] = field(default_factory=list)  # never started
    todo: list[Sample] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"total": self.total, "done": self.done, "interrupted": len(self.interrupted),
                "failed_retry": len(self.failed_retry), "failed_final": len(self.failed_final),
                "interrupted_final": len(self.interrupted_final),
                "damaged": len(self.damaged), "pending": len(self.pending), "todo": len(self.todo),
                "retired": self.retired}


def import_starts(log: EventLog) -> dict[str, int]:
    """Per sample, the `started` events of imports since it last started over (`superseded`): reading a dump
    file is no extraction attempt."""
    _, rows = log.query(
        "WITH resets AS (SELECT sample_id, max(seq) AS rseq FROM events WHERE kind = 'superseded' GROUP BY 1) "
        "SELECT e.sample_id, count(*) FROM events e LEFT JOIN resets r USING (sample_id) WHERE e.kind = 'started' "
        "AND json_extract_string(e.detail, '$.origin') = 'import' AND e.seq > coalesce(r.rseq, 0) GROUP BY 1")
    return dict(rows)


def make_plan(log: EventLog, samples: list[Sample], max_attempts: int, limit: int | None = None) -> Plan:
    states = {r["sample_id"]: r for r in log.samples()}
    imported = import_starts(log)
    plan = Plan(total=len(samples))
    for s in samples:
        row = states.get(s.sample_id)
        state = row["state"] if row else "pending"
        plan.attempts[s.sample_id] = row["starts"] if row else 0  # numbers the next attempt
        # counted against max_attempts: the extraction attempts since the sample last started over
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
    plan.total -= plan.retired
    if limit is not None:
        plan.todo = plan.todo[:limit]
    return plan
