"""Engine supervision: a server backend's inference server during a run (builder/run/server_lifecycle.py, or one per
node with --ray: builder/run/ray_engines.py). Start it and check it is the build's before a sample goes to it;
watch its health while the run lasts (a dead one fails its requests at once, a hung one is noticed by its
silence); pause dispatch while it is unavailable or its staging volume is full, restart it in launch mode, and
resume once it answers again; refuse a server that came back as another.

`Supervisor` owns all of it: the engine, whether it is down and why, and whether the engine's side stopped the
run. For a backend without a server it has no engine and every answer is "nothing to say".
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import EXIT_PREFLIGHT, EXIT_WONT_FIT
from builder.log.events import Event, detail

if TYPE_CHECKING:
    from builder.log.session import OwnerSession
    from builder.run.preparation import Prepared

HUNG_SECONDS = float(os.environ.get("HSBUILD_SERVER_HUNG", "60"))  # an engine's server silent this long is hung


@dataclass(frozen=True)
class EngineStop:
    """The engine's side stopped the run: its outcome, exit code and the one line the CLI prints."""

    outcome: str
    exit_code: int
    message: str


class Supervisor:
    """The run's engine (see the module's docstring). `prep`: the run's start; the engine is made by `start`."""

    def __init__(self, prep: Prepared, session: OwnerSession, echo: Callable[[str], None]):
        self._prep, self._session, self._echo = prep, session, echo
        self._engine = None  # server_lifecycle.Engine, or RayEngines (--ray): one server per node
        self._down: float | None = None  # since when the server has been unavailable
        self._reason = "server_unavailable"  # or staging_full: its staging volume had no room (ENOSPC)
        self._message: str | None = None  # why the engine paused the run (said by status)
        self._staging_need = 0  # bytes the staging volume must have free again (staging_full)
        self._refused: str | None = None  # the server that came back mid-run is not the build's: the run stops
        self._too_small: str | None = None  # the staging volume can never hold a sample's file: it stops
        self._trusted: str | None = None  # --trust-server let a server pass whose configuration cannot be read
        self._checked = 0.0
        self.pauses = 0  # pauses of the run for its engine

    # -- what the others ask ---------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """An engine was started (and is stopped by `stop`)."""
        return self._engine is not None

    def down(self) -> bool:
        """The engine cannot take samples now: dispatch waits."""
        return self._down is not None

    def stop_reason(self) -> EngineStop | None:
        """Whether the engine's side stopped the run: refused (exit 4), or a staging volume too small for a
        sample's file (exit 3); None while it did not."""
        if self._refused:
            return EngineStop("refused", EXIT_PREFLIGHT, self._refused)
        if self._too_small:
            return EngineStop("staging_too_small", EXIT_WONT_FIT, self._too_small)
        return None

    def too_small_message(self) -> str | None:
        return self._too_small

    def model_name(self) -> str:
        """The name requests use (the model served), once checked; "" without an engine."""
        return (self._engine.model_name or self._prep.cfg.model) if self._engine is not None else ""

    def staging_dir(self) -> str:
        return str(getattr(self._engine, "staging_dir", ""))

    def nodes(self) -> list[str | None] | None:
        """--ray with a server backend: the nodes whose server is up (one worker each); None otherwise."""
        engines = getattr(self._engine, "engines", None)
        return list(engines) if engines is not None else None

    def gone(self) -> dict[str, str]:
        """--ray: the nodes whose server's host is gone, and why."""
        return dict(getattr(self._engine, "gone", {}))

    def server_check(self, node: str | None = None) -> object | None:
        """The identity check a worker runs whenever the server comes back (its node's, on Ray)."""
        if node is not None:
            return self._engine.worker_check(node)
        return getattr(self._engine, "server_check", None)

    def settings_at(self, backend_settings: object, node: str) -> object:
        """The backend's worker settings pointed at node `node`'s server (--ray)."""
        return self._engine.worker_settings(backend_settings, node)

    def status(self, in_flight: int) -> dict:
        """What `status` says of the engine (nothing without one), and whether it pauses the run."""
        if self._engine is None:
            return {}
        files, sizes = self._engine.staging_usage()
        return {"backend": self._prep.cfg.backend, "server": self._engine.server,
                "server_healthy": self._down is None or self._reason == "staging_full",
                "server_restarts": self._engine.restarts, "in_flight": in_flight,
                "staging_files": files, "staging_bytes": sizes,
                **({"trust_server": self._trusted} if self._trusted else {})}

    def pause_status(self) -> dict | None:
        """The pause the engine holds the run in (reason, message, seconds), or None."""
        if self._down is None:
            return None
        return {"reason": self._reason, "message": self._message,
                "seconds": round(time.monotonic() - self._down, 1)}

    # -- the run's calls -----------------------------------------------------------------------------------------
    def start(self, meta: dict, first_probe: dict | None, ray_pool=None) -> None:  # noqa: ANN001
        """Wait for the server (launch it with --launch), probe it, record the probe. The first probe of a build
        (`first_probe`) is its reference: a later server returning other states for the same prompt is another
        model. `ray_pool`: --ray, one server per node, each with its own worker."""
        opts = self._prep.opts
        if ray_pool is not None:
            from builder.run.ray_engines import RayEngines  # noqa: PLC0415

            self._engine = RayEngines(ray_pool.ray, ray_pool.nodes(), self._prep.lay, self._prep.cfg, meta,
                                      opts.launch, self._echo, trust_server=opts.trust_server)
        else:
            from builder.run.server_lifecycle import Engine, EngineOptions  # noqa: PLC0415 - (torch: engine builds only)

            self._engine = Engine(self._prep.lay, self._prep.cfg, meta,
                                  EngineOptions(launch=opts.launch, trust_server=opts.trust_server), self._echo)
        self._engine.start(lambda: bool(self._session.stop_requested))
        from builder.run.server_lifecycle import EngineRefused  # noqa: PLC0415

        try:
            found = self._engine.check(first_probe)
        except EngineRefused as e:  # not the build's server: nothing was sent to it; the refusal is logged
            self._session.emit(Event("engine_refused", detail=detail(message=str(e), server=self._engine.server)))
            self._session.flush(force=True)
            raise
        self._engine.watch()
        self._session.emit(Event("engine_probe", detail=detail(server=self._engine.server, launched=opts.launch,
                                                               trust_server=opts.trust_server, **found)))
        self._session.flush(force=True)
        if found.get("trusted"):
            self._trusted = found["trusted"]
            self._echo(f"--trust-server: {self._engine.server}'s configuration cannot be read ({found['trusted']}); "
                       "judged by its answers alone (recorded in the run's engine_probe event)")

    def watch(self) -> None:
        """Every few seconds: is the server still healthy? (A dead one fails its requests at once; a hung one
        would hold them until their timeout.) While it is unavailable: restart it (launch mode), and lift the
        pause once it answers again."""
        now = time.monotonic()
        if self._engine is None:
            return
        if self._down is None:
            silent = self._engine.unresponsive_for()
            if silent > HUNG_SECONDS:  # alive (its requests do not fail) but not answering: hung
                self.unavailable(f"{self._engine.server}/health has not answered for {silent:.0f} s")
                self._engine.kill_hung()
            return
        if now - self._checked < 1.0:
            return
        self._checked = now
        self._engine.restart_if_dead()
        if self._engine.healthy() and self._staging_has_room():
            down = now - self._down
            self._down = None
            self._engine.watch()  # silence counts from now
            self._session.emit(Event("resumed", reason=self._reason, detail=detail(down_seconds=round(down, 1))))
            self._session.flush(force=True)
            self._echo("\nresumed: " + (f"the staging volume has room again after {down:.0f} s"
                                          if self._reason == "staging_full" else
                                          f"{self._engine.server} is healthy again after {down:.0f} s")
                       + "; the server is checked again before samples go to it")
            self._reason = "server_unavailable"

    def rechecked(self, worker: int, found: dict) -> None:
        """A worker checked the server again when it came back: it is the build's (recorded)."""
        self._session.emit(Event("engine_probe", worker=worker, detail=detail(
            server=self._engine.server if self._engine is not None else None, recheck=True, **found)))
        self._session.flush(force=True)

    def refused(self, message: str) -> None:
        """The server came back as another (model, layers, staging): nothing more goes to it; the run stops at a
        safe point (what was written before stays: it was checked against the server the run began with)."""
        if self._refused is not None:
            return
        self._refused = message
        self._session.emit(Event("engine_refused", detail=detail(message=message)))
        self._session.flush(force=True)
        self._echo(f"\nREFUSED: {message}; no more samples go to it; stopping at a safe point")

    def staging_too_small(self, message: str) -> None:
        """The staging volume cannot hold a sample's file even when empty: waiting for room would wait forever.
        The run stops at a safe point (exit 3); what was written stays; the sample went back to pending."""
        if self._too_small is not None:
            return
        self._too_small = message
        self._echo("\nSTOPPING (staging_too_small): the staging volume can never hold a sample's staging file "
                   "(below); stopping at a safe point")

    def unavailable(self, message: str, need_bytes: int = 0) -> None:
        """Pause dispatch: the server is gone (server_unavailable) or its staging volume is full (staging_full:
        `need_bytes` free again resumes it). Neither is the samples' fault. Not while the run stops because of
        its engine (refused, staging too small): the requests it abandons are no pause."""
        if self._refused or self._too_small:
            return
        if need_bytes:
            self._staging_need = max(self._staging_need, need_bytes)
        if self._down is not None:
            if need_bytes and self._reason != "staging_full":
                self._reason, self._message = "staging_full", message
            return
        self._down = time.monotonic()
        self._reason = "staging_full" if need_bytes else "server_unavailable"
        self._message = message
        self.pauses += 1
        self._session.emit(Event("paused", reason=self._reason, detail=detail(message=message)))
        self._session.flush(force=True)
        self._echo(f"\nPAUSED ({self._reason}): {message}; in-flight samples go back to pending; "
                   + ("waiting until the staging volume has room" if need_bytes else
                      "restarting the server" if self._prep.opts.launch else "waiting for the server to be healthy"))

    def _staging_has_room(self) -> bool:
        from builder.extract.backends.staging import volume_room  # noqa: PLC0415

        if not self._staging_need:
            return True
        try:
            free, _ = volume_room(Path(self._engine.staging_dir))
        except (OSError, AttributeError):
            return True
        if free < self._staging_need:
            return False
        self._staging_need = 0
        return True

    def stop(self) -> None:
        """At the run's end: the engine's server stopped (launch mode), its staging subfolder cleared."""
        if self._engine is not None:
            self._engine.stop()


def first_probe(log) -> dict | None:  # noqa: ANN001 - an EventLog
    """The build's first `engine_probe` (its reference: a re-check's or a trusted one never becomes it)."""
    first = log.query("SELECT detail FROM events WHERE kind = 'engine_probe' AND "
                      "coalesce(json_extract(detail, '$.recheck')::BOOLEAN, false) = false ORDER BY seq "
                      "LIMIT 1")[1]
    return json.loads(first[0][0]) if first and first[0][0] else None
