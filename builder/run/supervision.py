"""Engine supervision: a server backend's inference server during a run (builder/run/server_lifecycle.py, or one per
node with --ray: builder/run/ray_engines.py). Start it and check it is the build's before a sample goes to it;
watch its health while the run lasts (a dead one fails its requests at once, a hung one is noticed by its
silence); pause dispatch while it is unavailable or its staging volume is full, restart it in launch mode, and
resume once it answers again; refuse a server that came back as another.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import EXIT_PREFLIGHT, EXIT_WONT_FIT
from builder.log.events import Event, detail

if TYPE_CHECKING:
    from builder.run.coordinator import RunReport

HUNG_SECONDS = float(os.environ.get("HSBUILD_SERVER_HUNG", "60"))  # an engine's server silent this long is hung


class SupervisionMixin:
    """The Coordinator's supervision of its engine (`self.engine`; None for a backend without a server).
    (Mixed into Coordinator: uses its events, echo, options and stop requests.)"""

    def _engine_status(self) -> dict:
        if self.engine is None:
            return {}
        files, sizes = self.engine.staging_usage()
        st = getattr(self, "_st", None)
        return {"backend": self.cfg.backend, "server": self.engine.server,
                "server_healthy": self.engine_down is None or self.engine_reason == "staging_full",
                "server_restarts": self.engine.restarts,
                "in_flight": len(st.in_flight) if st is not None else 0,
                "staging_files": files, "staging_bytes": sizes,
                **({"trust_server": self.trusted} if getattr(self, "trusted", None) else {})}

    def _start_engine(self, meta: dict) -> None:
        """Wait for the server (launch it with --launch), probe it, record the probe. The first probe of a build
        is its reference: a later server returning other states for the same prompt is another model."""
        if self.opts.ray:  # one server per node, each with its own worker (builder/run/ray_engines.py)
            from builder.run.ray_engines import RayEngines  # noqa: PLC0415

            self.pool = self._ray_pool()
            self.engine = RayEngines(self.pool.ray, self.pool.nodes(), self.lay, self.cfg, meta, self.opts.launch,
                                     self.echo, trust_server=self.opts.trust_server)
        else:
            from builder.run.server_lifecycle import Engine, EngineOptions  # noqa: PLC0415 - (torch: engine builds only)

            self.engine = Engine(self.lay, self.cfg, meta,
                                 EngineOptions(launch=self.opts.launch, trust_server=self.opts.trust_server), self.echo)
        self.engine.start(lambda: bool(self.stop_requested))
        # the reference: the build's first probe (a re-check's or a trusted one never becomes it)
        first = self.log.query("SELECT detail FROM events WHERE kind = 'engine_probe' AND "
                               "coalesce(json_extract(detail, '$.recheck')::BOOLEAN, false) = false ORDER BY seq "
                               "LIMIT 1")[1]
        recorded = json.loads(first[0][0]) if first and first[0][0] else None
        from builder.run.server_lifecycle import EngineRefused  # noqa: PLC0415

        try:
            found = self.engine.check(recorded)
        except EngineRefused as e:  # not the build's server: nothing was sent to it; the refusal is logged
            self.emit(Event("engine_refused", detail=detail(message=str(e), server=self.engine.server)))
            self.flush(force=True)
            raise
        self.engine.watch()
        self.emit(Event("engine_probe", detail=detail(server=self.engine.server, launched=self.opts.launch,
                                                      trust_server=self.opts.trust_server, **found)))
        self.flush(force=True)
        if found.get("trusted"):
            self.trusted = found["trusted"]
            self.echo(f"--trust-server: {self.engine.server}'s configuration cannot be read ({found['trusted']}); "
                      "judged by its answers alone (recorded in the run's engine_probe event)")

    def _engine_watch(self, report: RunReport) -> None:
        """Every few seconds: is the server still healthy? (A dead one fails its requests at once; a hung one
        would hold them until their timeout.) While it is unavailable: restart it (launch mode), and lift the
        pause once it answers again."""
        now = time.monotonic()
        if self.engine is None:
            return
        if self.engine_down is None:
            silent = self.engine.unresponsive_for()
            if silent > HUNG_SECONDS:  # alive (its requests do not fail) but not answering: hung
                self._engine_unavailable(f"{self.engine.server}/health has not answered for {silent:.0f} s",
                                         report)
                self.engine.kill_hung()
            return
        if now - self.engine_checked < 1.0:
            return
        self.engine_checked = now
        self.engine.restart_if_dead()
        if self.engine.healthy() and self._staging_has_room():
            down = now - self.engine_down
            self.engine_down = None
            self.engine.watch()  # silence counts from now
            self.emit(Event("resumed", reason=self.engine_reason, detail=detail(down_seconds=round(down, 1))))
            self.flush(force=True)
            self.echo("\nresumed: " + (f"the staging volume has room again after {down:.0f} s"
                                         if self.engine_reason == "staging_full" else
                                         f"{self.engine.server} is healthy again after {down:.0f} s")
                      + "; the server is checked again before samples go to it")
            self.engine_reason = "server_unavailable"

    def _drop_serverless_workers(self) -> None:
        """--ray with an engine backend: a node whose server's host is gone (its EngineHost actor died, the node
        may live on) leaves its worker with no server: that worker is stopped, so it is lost like one on a lost
        node (its samples back to pending), rather than failing every request and pausing the run again and
        again."""
        for nid in list(getattr(self.engine, "gone", {})):
            for proc in self._node_workers.pop(nid, []):
                if proc.is_alive():
                    proc.lost = f"the host of node {nid[:12]}'s server is gone ({self.engine.gone[nid]})"
                    proc.kill()

    def _server_refused(self, message: str) -> None:
        """The server came back as another (model, layers, staging): nothing more goes to it; the run stops at a
        safe point (what was written before stays: it was checked against the server the run began with)."""
        if self.refused is not None:
            return
        self.refused = message
        self.emit(Event("engine_refused", detail=detail(message=message)))
        self.flush(force=True)
        self.echo(f"\nREFUSED: {message}; no more samples go to it; stopping at a safe point")

    def _staging_too_small(self, message: str) -> None:
        """The staging volume cannot hold a sample's file even when empty: waiting for room would wait forever.
        The run stops at a safe point (exit 3); what was written stays; the sample went back to pending."""
        if self.staging_too_small is not None:
            return
        self.staging_too_small = message
        self.echo("\nSTOPPING (staging_too_small): the staging volume can never hold a sample's staging file "
                  "(below); stopping at a safe point")

    def _engine_outcome(self, report: RunReport) -> None:
        """The outcome of a run that the engine's side stopped: refused (exit 4), or a staging volume too small for
        a sample's file (exit 3); the message is the one line the CLI prints."""
        if self.refused:
            report.outcome, report.exit_code = "refused", EXIT_PREFLIGHT
        else:
            report.outcome, report.exit_code = "staging_too_small", EXIT_WONT_FIT
        report.messages.append(self.refused or self.staging_too_small or "")

    def _engine_unavailable(self, message: str, report: RunReport, need_bytes: int = 0) -> None:
        """Pause dispatch: the server is gone (server_unavailable) or its staging volume is full (staging_full:
        `need_bytes` free again resumes it). Neither is the samples' fault. Not while the run stops because of
        its engine (refused, staging too small): the requests it abandons are no pause."""
        if self.refused or self.staging_too_small:
            return
        if need_bytes:
            self.staging_need = max(self.staging_need, need_bytes)
        if self.engine_down is not None:
            if need_bytes and self.engine_reason != "staging_full":
                self.engine_reason, self.engine_message = "staging_full", message
            return
        self.engine_down = time.monotonic()
        self.engine_reason = "staging_full" if need_bytes else "server_unavailable"
        self.engine_message = message
        report.pauses += 1
        self.emit(Event("paused", reason=self.engine_reason, detail=detail(message=message)))
        self.flush(force=True)
        self.echo(f"\nPAUSED ({self.engine_reason}): {message}; in-flight samples go back to pending; "
                  + ("waiting until the staging volume has room" if need_bytes else
                     "restarting the server" if self.opts.launch else "waiting for the server to be healthy"))

    def _staging_has_room(self) -> bool:
        from builder.extract.backends.staging import volume_room  # noqa: PLC0415

        if not self.staging_need:
            return True
        try:
            free, _ = volume_room(Path(self.engine.staging_dir))
        except (OSError, AttributeError):
            return True
        if free < self.staging_need:
            return False
        self.staging_need = 0
        return True
