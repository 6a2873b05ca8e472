"""The fold, in Python: the reference the `samples` view (schema/views.sql) must agree with (tested with
Hypothesis)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields

from builder.log.events import Event
from builder.log.kinds import TRANSIENT_REASONS, EventKind

__all__ = ["TRANSIENT_REASONS", "SampleState", "fold", "is_import_start"]

# a sample's main events: its state is the last one's (docs/design.md section 3, "The fold")
MAIN_KINDS = (EventKind.STARTED, EventKind.WRITTEN, EventKind.FAILED, EventKind.SUPERSEDED, EventKind.RETIRED)


def is_import_start(ev: Event) -> bool:
    """A `started` event of an import (reading a dump file: no extraction attempt; the plan leaves these out)."""
    if ev.kind != EventKind.STARTED or ev.detail is None:
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
        if ev.kind == EventKind.STARTED:
            s.attempts += 1
        if (ev.kind == EventKind.FAILED and ev.reason in TRANSIENT_REASONS and main is not None
                and main.kind == EventKind.STARTED and not is_import_start(main)):
            s.attempts -= 1  # the environment's failure: that start was no attempt
        if ev.kind == EventKind.SUPERSEDED:
            s.attempts = 0
        if ev.kind == EventKind.VERIFIED:
            last_verified = ev.seq
        elif ev.kind in MAIN_KINDS:
            main = ev
    if main is None or main.kind == EventKind.SUPERSEDED:
        return s
    s.state = str(main.kind)
    if main.kind == EventKind.RETIRED:
        s.retired_reason = main.reason
    if main.kind == EventKind.WRITTEN:
        s.segment, s.token_start, s.num_tokens = main.segment, main.token_start, main.num_tokens
        if last_verified is not None and main.seq is not None and last_verified > main.seq:
            s.state = "verified"
            s.verified_seq = last_verified
    elif main.kind == EventKind.FAILED:
        s.error = main.reason
        if main.reason in TRANSIENT_REASONS:  # the environment's fault: back to pending, retried uncounted
            s.state = "pending"
    return s
