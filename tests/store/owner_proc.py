"""A log owner in a process of its own, for test_state_machine.py's coordinator-crash rule. Kept apart from the
test module so the forked child imports only the event log (not Hypothesis)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path

from builder.log.events import Event, EventLog


def own_and_commit(path: str, events: list[Event], conn: Connection) -> None:
    """Open the log as its owner, say so, commit one batch (one transaction), say so, then wait to be killed."""
    log = EventLog(Path(path))
    conn.send("open")
    log.append(events)
    conn.send("committed")
    time.sleep(600)
