"""The fold, in Python: the reference the `samples` view (schema/views.sql) must agree with (tested with
Hypothesis)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields

from builder.log.events import Event

# Failures of the environment, not of the sample (a full volume, an inference server down, a Ray node or actor
# gone): the start they end is no attempt, so it never counts against --max-attempts nor toward the limit on
# interrupted starts (builder/run/plan.py). The one list: schema/views.sql (`sample_fold`) spells out the same,
# and tests/log/test_transient_reasons.py fails when the two differ.
TRANSIENT_REASONS = frozenset({"no_space", "server_unavailable", "worker_lost"})


def is_import_start(ev: Event) -> bool:
    """A `started` event of an import (reading a dump file: no extraction attempt; the plan leaves these out)."""
    if ev.kind != "started" or ev.detail is None:
        return False
    try:
        d = json.loads(ev.detail)
    except ValueError:
        return False
    return isinstance(d, dict) and d.get("origin") == "import"


@dataclass
class SampleState:
    state: str = "pending"
    attempts: int = 0
    segment: str | None = None
    token_start: int | None = None
    num_tokens: int | None = None
    error: str | None = None
    retired_reason: str | None = None
    verified_seq: int | None = None

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "verified_seq")


def fold(events: Iterable[Event]) -> SampleState:
    """State of one sample from its events (in log order). `superseded` (its source row changed, or it came
    back) starts it over: pending, attempts counted from there; `retired` (removed from the source, skipped)
    takes it out of the build until a `superseded`. A `failed` for a transient reason (TRANSIENT_REASONS) is
    pending: the sample went back to be retried (`error` keeps the reason its last try ended with).

    `attempts`: its `started` events since the last `superseded`, less each extraction start (not an import's)
    that a transient failure ended (TRANSIENT_REASONS as the sample's next started/written/failed/superseded/
    retired event). A start left in flight (`started` is the last word) counts. The plan leaves out the starts
    of imports besides (the view's `imports`)."""
    s = SampleState()
    main: Event | None = None
    last_verified: int | None = None
    for ev in events:
        if ev.kind == "started":
            s.attempts += 1
        if (ev.kind == "failed" and ev.reason in TRANSIENT_REASONS and main is not None and main.kind == "started"
                and not is_import_start(main)):
            s.attempts -= 1  # the environment's failure: that start was no attempt
        if ev.kind == "superseded":
            s.attempts = 0
        if ev.kind == "verified":
            last_verified = ev.seq
        elif ev.kind in ("started", "written", "failed", "superseded", "retired"):
            main = ev
    if main is None or main.kind == "superseded":
        return s
    s.state = main.kind
    if main.kind == "retired":
        s.retired_reason = main.reason
    if main.kind == "written":
        s.segment, s.token_start, s.num_tokens = main.segment, main.token_start, main.num_tokens
        if last_verified is not None and main.seq is not None and last_verified > main.seq:
            s.state = "verified"
            s.verified_seq = last_verified
    elif main.kind == "failed":
        s.error = main.reason
        if main.reason in TRANSIENT_REASONS:  # the environment's fault: back to pending, retried uncounted
            s.state = "pending"
    return s
