"""An export from a build this process cannot write (a read-only mount, a snapshot, no write permission): an
export only reads the build, so it goes on without owning it (builder/exchange/export.py).

- The build lock is held *shared* (flock LOCK_SH on `hsbuild.lock`, opened read-only: no write) for the whole
  export, so no owner (a run, verify, gc: they take it exclusive) can start meanwhile, through this mount or
  another; a live owner makes the export busy (exit 5), a record of an owner on another host that never
  released it is refused unless --take-over, both as where the build can be written.
- The log is opened read-only, and no `export` event is recorded: the caller says so (ExportReport.recorded).
- The first SIGINT/SIGTERM asks for a stop at the next file boundary (Interrupted: the same command continues),
  a second exits 130 at once (still resumable), as in an owner session.
- No query socket: `hsbuild status` shows the build idle meanwhile (readers are not owners).
"""

from __future__ import annotations

import os
import signal
import threading

from builder.errors import EXIT_INTERRUPTED
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log
from builder.log.lock import BuildLock

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ReadOnlyBuild:
    """What `export_build` needs of an owner session (`open`, `stop_requested`), for a build it cannot write."""

    def __init__(self, lay: BuildLayout, take_over: bool = False):
        self.lay, self.take_over = lay, take_over
        self.stop_requested = 0
        self.status_fn = None  # (no query socket: nobody asks)
        self.log: EventLog | None = None
        self._lock: BuildLock | None = None
        self._old_handlers: dict = {}

    def __enter__(self) -> ReadOnlyBuild:
        self._lock = BuildLock(self.lay, "export", take_over=self.take_over).acquire_shared()
        return self

    def open(self) -> EventLog:
        self.log = open_log(self.lay.events, read_only=True)
        if threading.current_thread() is threading.main_thread():
            self._old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self.log

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.stop_requested += 1
        if self.stop_requested >= 2:
            os._exit(EXIT_INTERRUPTED)

    def close(self) -> None:
        try:
            if self.log is not None:
                self.log.close()
                self.log = None
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers = {}

    def __exit__(self, *exc: object) -> None:
        self.close()
