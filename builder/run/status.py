"""What a live run says of itself: its pause on the disk watermarks (`SpacePause`), and what `hsbuild status` gets
from it (`live_status`, composed from what each part of the run answers: the log's progress and the space
projection, the pause, the engine's state, the nodes on Ray).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from builder.log.events import Event, detail
from builder.space.capacity import project

if TYPE_CHECKING:
    from builder.log.events import EventLog
    from builder.log.session import OwnerSession
    from builder.run.standby import Flags
    from builder.run.supervision import Supervisor
    from builder.space.watermarks import SpaceMonitor


class SpacePause:
    """Dispatch stopped and the writers held (the workers' gate closed) while a volume is above its high
    watermark, until it is below the low one (the space monitor decides, builder/space/watermarks.py). Owns
    whether the run is paused so, why, and how often it was."""

    def __init__(self, session: OwnerSession, space: SpaceMonitor, flags: Flags, echo: Callable[[str], None]):
        self._session, self._space, self._flags, self._echo = session, space, flags, echo
        self._reason: str | None = None
        self.pauses = 0

    @property
    def reason(self) -> str | None:
        """Why the run is paused for space (None: it is not)."""
        return self._reason

    def poll(self, force: bool = False) -> None:
        """The monitor's figures (fresh when `force`, else when due): pause or resume as they say."""
        reason = self._space.poll(force=force)
        if reason != self._reason:
            self._set(reason)

    def gate(self) -> str | None:
        """Asked before each sample is handed out (fresh figures): the reason to pause now, if any (paused)."""
        reason = self._space.poll(force=True)
        if reason is not None:
            self._set(reason)
        return reason

    def _set(self, reason: str | None) -> None:
        figures = self._space.snapshot()
        # the reason first: a `status` asked as soon as the line below is printed (from the query thread) says so
        was, self._reason = self._reason, reason
        if reason is not None:
            self._flags.gate_open = False
            self.pauses += 1
            self._session.emit(Event("paused", reason=reason, detail=detail(**figures)))
            self._echo(f"\nPAUSED ({reason}): {self._space.describe()}; resumes by itself below the low watermark")
        else:
            self._flags.gate_open = True
            self._session.emit(Event("resumed", reason=was, detail=detail(**figures)))
            self._echo(f"\nresumed: {self._space.describe()}")
        self._session.flush(force=True)


def live_status(run_id: str, workers: int, log: EventLog, space: SpaceMonitor, meta: dict | None,
                space_pause: str | None, engine: Supervisor | None, in_flight: int, ray: bool) -> dict:
    """What `status` gets from a running run (asked from the owner session's query thread)."""
    prog = log.progress()
    engine_pause = engine.pause_status() if engine is not None else None
    if space_pause is not None or engine_pause is not None:
        prog["eta_seconds"] = None  # no ETA while paused: nothing is being written
    return {"running": True, "run_id": run_id, "pid": os.getpid(), "workers": workers,
            **prog, **(project(log, space, meta, progress=prog) if meta is not None else {}),
            **space.snapshot(),
            "paused": space_pause is not None or engine_pause is not None,
            "pause_reason": space_pause or (engine_pause["reason"] if engine_pause else None),
            "pause_message": (space.describe() if space_pause is not None else
                              engine_pause["message"] if engine_pause else None),
            "paused_for_s": engine_pause["seconds"] if engine_pause and space_pause is None else None,
            **(engine.status(in_flight) if engine is not None else {}),
            # on Ray: per node (what `status` prints and --metrics serves per node)
            **({"nodes": log.query_dicts("SELECT * FROM nodes WHERE run_id = ?", [run_id])} if ray else {})}
