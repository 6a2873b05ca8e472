"""The coordinator: the one owner of the event log during a run.

It replays the log into a plan, starts the workers, hands them samples, commits their reports in batches,
answers live queries over its socket, pauses writers on disk watermarks, and stops at a safe point on Ctrl-C.

This module holds the run itself (`run_build`, `RunOptions`, `RunReport`, and the Coordinator's main loop); the
Coordinator's other parts are mixins, each in its own module: `spawning` (starting the workers), `preparation`
(the source, the log caught up with the data, an import's record), `supervision` (a server backend's engine),
`dispatch` (who holds which sample; the queue bounds; stopping the workers) and `handling` (the workers'
reports). What the run does differently per backend, it asks the backend's spec
(builder/extract/backends/registry.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import AUTO_WORKERS, is_count, load_config, require_same_format
from builder.doctor.gpu import GpuSampler
from builder.doctor.report import preflight_for_run, warning_lines
from builder.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SAMPLES_FAILED,
    Interrupted,
    UsageError,
)
from builder.extract.backends import registry as backends
from builder.extract.source import Sample, load_source
from builder.extract.spec import check_device_spec
from builder.extract.threads import fix_threading
from builder.layout import layout
from builder.log.events import Event, detail
from builder.log.lock import BuildLock
from builder.log.session import OwnerSession
from builder.progress import NoProgress, Progress
from builder.run import testhook
from builder.run.create import code_fingerprint
from builder.run.dispatch import (  # (the constants and the underscored names: re-exported, as they were)
    ABORT_GRACE_SECONDS,
    PER_WORKER,
    QUEUE_SAMPLES,
    QUEUE_TOKENS,
    SHUTDOWN_SECONDS,
    STOP_GRACE_SECONDS,
    Dispatch,
    DispatchMixin,
    Outbox,
    stop_grace,
    stop_workers,
)
from builder.run.handling import HandlingMixin
from builder.run.messages import Stop, WorkerSettings
from builder.run.plan import Plan, make_plan
from builder.run.preparation import PreparationMixin, tokenizer_for
from builder.run.sizing import workers_for
from builder.run.spawning import RAY_CPUS_PER_WORKER, SpawningMixin
from builder.run.standby import Flags, Standby, loads_hf_model
from builder.run.supervision import HUNG_SECONDS, SupervisionMixin
from builder.run.worker_start import worker_context
from builder.space.capacity import measured_bytes_per_token, project, stored_tokens
from builder.space.watermarks import SpaceMonitor
from builder.store.codec import parse_codec
from builder.store.history import next_ordinal

if TYPE_CHECKING:  # (these import torch: only import and engine runs need them, and import them there)
    from builder.exchange.imports import DumpIndex, ImportOptions
    from builder.run.server_lifecycle import Engine

_Dispatch, _Outbox, _stop_workers = Dispatch, Outbox, stop_workers  # (their names before the split)
__all__ = ["ABORT_GRACE_SECONDS", "HUNG_SECONDS", "PER_WORKER", "QUEUE_SAMPLES", "QUEUE_TOKENS",
           "RAY_CPUS_PER_WORKER", "SHUTDOWN_SECONDS", "STOP_GRACE_SECONDS", "Coordinator", "RunOptions", "RunReport",
           "run_build"]


@dataclass
class RunOptions:
    workers: int | str | None = None  # a count, or "auto" (builder/run/sizing.py); None: the config's
    limit: int | None = None
    max_attempts: int | None = None
    device: str | None = None
    verify_after_write: bool | None = None
    allow_overcommit: bool = False
    force: bool = False
    progress: Progress | None = None  # where progress is reported (the CLI draws a bar); None: nowhere
    low: float | None = None
    high: float | None = None
    flood: float | None = None
    min_free: int | None = None
    # after Ctrl-C/SIGTERM, seconds the workers get to finish the sample in hand before they are killed (named,
    # their sample left for resume); None: $HSBUILD_STOP_GRACE, else 30
    stop_grace: float | None = None
    take_over: bool = False  # take the lock over from an owner on another host (--take-over)
    launch: bool = False  # engine backends: start the server as a child (`serve-command`), stop it at the end
    trust_server: bool = False  # engine backends: a server whose configuration cannot be read is judged by its
    # answers alone (recorded in engine_probe; status shows it)
    inflight: int | None = None  # engine backends: requests in flight (overrides hsbuild.toml)
    imports: ImportOptions | None = None  # `hsbuild import`: states from a dump's files, not forward passes
    source: str | None = None  # the build's source moved here (--source): recorded, hsbuild.toml updated
    accept_source_changes: bool = False  # record changed/removed source rows instead of refusing them
    ray: str | None = None  # workers as actors on this Ray cluster ('auto' or host:port); None: local processes
    # local workers already spawned (the CLI starts them before importing this module); the run owns and closes
    # it. None: the run spawns its own as soon as it holds the lock
    standby: Standby | None = None
    metrics: str | None = None  # serve Prometheus metrics at this host:port while the run lasts (--metrics)


@dataclass
class RunReport:
    run_id: str
    plan: Plan
    written: int = 0
    failed: int = 0
    pauses: int = 0
    outcome: str = "completed"
    exit_code: int = EXIT_OK
    failed_in_build: int = 0
    messages: list[str] = field(default_factory=list)
    dump: DumpIndex | None = None  # an import: which file holds which sample, and the files that hold none
    rejected: list[dict] = field(default_factory=list)  # an import: files a worker refused (sample, reason)
    check_errors: int = 0  # --verify-after-write could not read these back: written, not checked (`check_error`)


class Coordinator(SpawningMixin, PreparationMixin, SupervisionMixin, DispatchMixin, HandlingMixin):
    """A run: see the module's docstring. Its parts: spawning (the workers), preparation (source, log, import
    record), supervision (a server backend's engine), dispatch (who holds which sample), handling (the workers'
    reports)."""

    def __init__(self, build: str | Path, opts: RunOptions | None = None, echo=print):
        self.standby: Standby | None = None
        testhook.check_environment()  # (the test suite's hook: a malformed value is refused before anything starts)
        self.lay = layout(build).require()
        self.opts = opts or RunOptions()
        self.cfg = load_config(self.lay)
        # the backend this run drives (builder/extract/backends/registry.py): the importer for an import
        self.backend = backends.for_run(self.cfg, self.opts.imports is not None, self.lay.config)
        if self.opts.max_attempts is not None:
            if self.opts.max_attempts < 1:
                raise UsageError("--max-attempts: must be at least 1")
            self.cfg.max_attempts = self.opts.max_attempts
        if self.opts.verify_after_write is not None:
            self.cfg.verify_after_write = self.opts.verify_after_write
        for k in ("low", "high", "flood", "min_free"):
            v = getattr(self.opts, k)
            if v is not None:
                setattr(self.cfg.watermarks, k, v)
        self.cfg.watermarks.validate()
        spec = self.cfg.workers if self.opts.workers is None else self.opts.workers
        self.workers_why: str | None = None  # what `auto` sized the count from (echoed, and in run_started)
        if spec == AUTO_WORKERS:
            if self.opts.ray and not self.backend.server and self.opts.imports is None:
                self.workers = 0  # one a node of the cluster, counted once connected (`_size_on_cluster`)
            else:
                count = workers_for(self.cfg, self.opts.device, importing=self.opts.imports is not None)
                self.workers, self.workers_why = count.workers, count.why
        elif not is_count(spec):
            raise UsageError(f"--workers {spec}: must be auto or at least 1")
        else:
            self.workers = spec
        self.stop_grace = stop_grace(self.opts.stop_grace)
        if self.opts.limit is not None and self.opts.limit < 0:
            raise UsageError(f"--limit {self.opts.limit}: must be 0 or more samples")
        check_device_spec(self.opts.device or self.cfg.device)
        if self.opts.ray is not None:
            from builder.run.ray_pool import check_address, check_reachable  # noqa: PLC0415

            check_address(self.opts.ray)
            if self.opts.imports is not None:
                raise UsageError(f"--ray {self.opts.ray}: an import reads a dump's files on this node; run it "
                                 "without --ray")
            if self.backend.server and not self.opts.launch:
                from builder.run.ray_engines import check_connect_server  # noqa: PLC0415

                check_connect_server(self.cfg)
            check_reachable(self.opts.ray)  # a silent address fails here, in one line, before the lock
        self.echo = echo
        self.run_id = uuid.uuid4().hex
        self.session: OwnerSession | None = None  # the owner session, once the build lock is held (`run`)
        self.meta: dict | None = None  # the build's metadata, once the log is open
        self._stop_before = 0  # a stop decided before the session exists
        self._landed = False  # a sample was written since the last watermark poll
        self.aborted: str | None = None  # a worker died: stop at a safe point, `resume` continues
        if self.opts.inflight is not None:
            if self.opts.inflight < 1:
                raise UsageError(f"--inflight {self.opts.inflight}: must be at least 1")
            self.cfg.inflight = self.opts.inflight
        self.dump_claim = None  # an import: the layers the dump holds, checked against the build's
        if self.opts.imports is not None:
            from builder.exchange.imports import check_dump, check_options  # noqa: PLC0415 - (torch: imports only)

            check_options(self.opts.imports)
            if self.opts.launch:
                raise UsageError("--launch: an import reads a dump's files; it needs no server")
            self.dump_claim = check_dump(self.opts.imports, self.lay)  # refused here: nothing touched yet
        self.dump_files: dict[str, str] = {}
        if self.opts.launch and not self.backend.server:
            raise UsageError(f"--launch: this build's backend is {self.backend.name} ({self.backend.summary}); "
                             "--launch starts an inference server for builds made with --backend "
                             + " or ".join(backends.with_server()))
        self.space = SpaceMonitor(self.lay, self.cfg)
        self.paused_reason: str | None = None
        self.engine: Engine | None = None  # or RayEngines (--ray): one server per node
        self.pool = None  # the Ray worker pool (--ray), once made
        self._ray_connected = None  # a RayPool connected (to count the nodes for `auto`), not yet probed
        self._node_workers: dict[str, list] = {}  # --ray with a server backend: node id -> its worker(s)
        self.engine_down: float | None = None  # since when the server has been unavailable
        self.engine_reason = "server_unavailable"  # or staging_full: its staging volume had no room (ENOSPC)
        self.engine_message: str | None = None  # why the engine paused the run (said by status)
        self.staging_need = 0  # bytes the staging volume must have free again (staging_full)
        self.refused: str | None = None  # the server that came back mid-run is not the build's: the run stops
        self.staging_too_small: str | None = None  # the staging volume can never hold a sample's file: it stops
        self.engine_checked = 0.0

    # -- the owner session: lock, log, commits, queries, signals, stalls (builder/log/session.py) ----------------
    @property
    def stop_requested(self) -> int:
        """Stop requests so far (Ctrl-C, SIGTERM, or the run's own decision): the run stops at a safe point."""
        return self.session.stop_requested if self.session is not None else self._stop_before

    @stop_requested.setter
    def stop_requested(self, value: int) -> None:
        if self.session is not None:
            self.session.stop_requested = value
            if value:
                self.session.stop_event.set()
        else:
            self._stop_before = value

    def _announce_stop(self) -> None:
        """Say once, from the main loop (never from the handler), that a stop was asked for."""
        if self.session is not None:
            self.session.announce_stop()

    # -- events -------------------------------------------------------------------------------------------
    def emit(self, ev: Event) -> None:
        self.batch.emit(ev)

    def flush(self, force: bool = False) -> None:
        self.session.flush(force)


    def status(self) -> dict:
        prog = self.log.progress()
        if self.paused_reason is not None or self.engine_down is not None:
            prog["eta_seconds"] = None  # no ETA while paused: nothing is being written
        return {"running": True, "run_id": self.run_id, "pid": os.getpid(), "workers": self.workers,
                **prog, **(project(self.log, self.space, self.meta, progress=prog) if self.meta is not None else {}),
                **self.space.snapshot(),
                "paused": self.paused_reason is not None or self.engine_down is not None,
                "pause_reason": self.paused_reason or (self.engine_reason if self.engine_down is not None else None),
                "pause_message": (self.space.describe() if self.paused_reason is not None else
                                  self.engine_message if self.engine_down is not None else None),
                "paused_for_s": (round(time.monotonic() - self.engine_down, 1) if self.engine_down is not None and
                                 self.paused_reason is None else None),
                **self._engine_status(),
                # on Ray: per node (what `status` prints and --metrics serves per node)
                **({"nodes": self.log.query_dicts("SELECT * FROM nodes WHERE run_id = ?", [self.run_id])}
                   if self.opts.ray else {})}

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunReport:
        staging = [Path(self.cfg.staging)] if self.cfg.staging and Path(self.cfg.staging).is_dir() else []
        session = OwnerSession(self.lay, "run", self.run_id, take_over=self.opts.take_over, echo=self.echo,
                               status=self.status, before_commit=self.space.before_commit, watch=staging,
                               metrics=self.opts.metrics)
        try:
            session.__enter__()  # the build lock; `status` answers from now on (the phase)
        except BaseException:
            if self.opts.standby is not None:
                self.opts.standby.close()
            raise
        self.session = session
        self.session.stop_requested = self._stop_before
        try:
            self.standby = self._standby()
            # validate the source before the log is even opened: bad input changes nothing
            session.phase = "starting: reading the source"
            self.source = self._source_path()
            samples = load_source(self.source, tokenizer_for(self.cfg), build=self.lay)
            session.phase = "starting: replaying the log"
            # (the signals are taken once the run has started: Ctrl-C before that ends it at once)
            self.log = session.open(signals=False)
            self.batch = session.batch
            return self._run_locked(session.lock, resume, samples)
        finally:
            try:
                if self.standby is not None:
                    self.standby.close()  # the workers not taken (nothing to do, a refusal, an error)
            finally:
                session.close()  # the log closed, the lock released, and only then the signals given back

    def _run_locked(self, lock: BuildLock, resume: bool, samples: list[Sample]) -> RunReport:
        meta = self.meta = self.log.meta()
        require_same_format(self.cfg, meta)  # never overridable: a build holds one format
        parse_codec(self.cfg.codec)  # a build made before init checked codec levels: refused here, not per sample
        added = self._check_source(samples)
        self._adopt_unlogged(lock.previous)
        importing = self.opts.imports is not None
        plan = make_plan(self.log, samples, self.cfg.max_attempts, None if importing else self.opts.limit)
        report = RunReport(self.run_id, plan)
        if importing:
            self._match_dump(plan, report, samples)
        else:
            self._say_replayed(plan, resume, added)
        if plan.todo:
            doc = preflight_for_run(self.lay, self.cfg, self.log, self.opts.force, {os.getpid()},
                                    # a server backend's GPUs are the server's, not hsbuild's
                                    device=self.backend.device or self.opts.device or self.cfg.device,
                                    run_id=self.run_id, previous_owner=lock.previous)
            self.gpu_build = doc.gpu_build
            for line in warning_lines(doc):
                self.echo(line)
        self.space.preflight(stored_tokens(plan.todo, self.cfg.max_tokens), meta, measured_bytes_per_token(self.log),
                             allow_overcommit=self.opts.allow_overcommit, echo=self.echo,
                             remaining_samples=len(plan.todo))
        by_id = {s.sample_id: s for s in plan.todo}
        self._give_up_interrupted(plan)
        if self.workers == 0 and plan.todo:  # --ray, auto: counted on the cluster
            self._size_on_cluster()
        self.workers = max(1, self.workers)  # (nothing to do: no cluster asked)
        if self.workers_why is not None and plan.todo and not self.backend.server:
            self.echo(f"workers: {self.workers} (auto: {self.workers_why})")
        # the ordinal this run's segments take in the build's history (data/history/): taken now, under the lock;
        # its record is written before the first segment (SegmentWriter.run_record), like any of its data
        self.history_ordinal = next_ordinal(self.lay.data)
        self.emit(Event("run_started", detail=detail(
            workers=self.workers, threads=self._threads(), resume=resume, plan=plan.summary(),
            **({"workers_auto": self.workers_why} if self.workers_why is not None else {}),
            config=self.cfg.to_toml(),
            config_fingerprint=self.cfg.fingerprint(), model_fingerprint=meta.get("model_fingerprint"),
            code_fingerprint=code_fingerprint(), pid=os.getpid(), previous_owner=lock.previous,
            history_ordinal=self.history_ordinal,
            **({"import": {"dir": str(Path(self.opts.imports.dir).absolute()), "format": self.opts.imports.format,
                           **report.dump.summary()}} if report.dump is not None else {}))))
        self.flush(force=True)
        # kept until the run has closed its log and released its lock (the session): a stop request in the run's
        # last moments is still a request, never the default action (a SIGTERM killing it mid-teardown)
        self.session.take_signals()
        try:
            if plan.todo and self.backend.server:
                try:
                    self._start_engine(meta)
                except Interrupted:  # Ctrl-C while waiting for the server: a stop like any other (exit 130)
                    self.stop_requested = max(self.stop_requested, 1)
                    self._announce_stop()
            if plan.todo and not self.stop_requested:
                self._extract(plan, by_id, meta, report)
        except BaseException as e:
            self.emit(Event("run_finished", reason="error", detail=detail(error=f"{type(e).__name__}: {e}")))
            self.flush(force=True)
            raise
        finally:
            try:
                if self.engine is not None:
                    self.engine.stop()
            finally:
                for ray_pool in (self.pool, self._ray_connected):  # (--ray with a server backend: after its servers)
                    if ray_pool is not None:
                        ray_pool.close()
        left = len(self._st.pending) if getattr(self, "_st", None) is not None else 0
        if left and not self.stop_requested and not self.aborted:  # (a safety net: no worker took them)
            self.aborted = f"{left} sample(s) were left pending with no worker to take them"
        report.failed_in_build = self.log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0]
        if report.dump is not None:
            self._record_import(report)
        if self.refused or self.staging_too_small:  # the engine's side stopped the run (supervision.py)
            self._engine_outcome(report)
        elif self.stop_requested:
            report.outcome, report.exit_code = "interrupted", EXIT_INTERRUPTED
        elif self.aborted:
            report.outcome, report.exit_code = "worker_died", EXIT_SAMPLES_FAILED
            report.messages.append(self.aborted)
        elif report.failed_in_build:
            report.exit_code = EXIT_SAMPLES_FAILED
        if report.check_errors:
            self.echo(f"{report.check_errors} sample(s) written but not checked: --verify-after-write could not read "
                      f"them back (an I/O error, not a mismatch; they stay written); check them with: "
                      f"hsbuild verify {self.lay.root}")
        self.emit(Event("run_finished", reason=report.outcome, detail=detail(
            written=report.written, failed=report.failed, pauses=report.pauses,
            failed_in_build=report.failed_in_build,
            **({"check_errors": report.check_errors} if report.check_errors else {}),
            **({"message": self.staging_too_small} if self.staging_too_small else {}))))
        self.flush(force=True)
        return report

    def _extract(self, plan: Plan, by_id: dict[str, Sample], meta: dict, report: RunReport) -> None:
        fix_threading()  # inherited by the workers before torch loads (there, or in the server they fork from)
        if self.standby is not None:  # its workers hold the run's flags since they were started
            ctx, flags = self.standby.ctx, self.standby.flags
        else:  # (Ray's workers are actors: no fork server for them)
            ctx = (mp.get_context("spawn") if self.pool is not None or self.opts.ray
                   else worker_context(hf=loads_hf_model(self.cfg, self.backend)))
            flags = Flags(ctx)
        threads = self._threads()
        procs: dict[int, mp.process.BaseProcess] = {}
        conns: dict[int, Connection] = {}  # reports from each worker (read here)
        outboxes: dict[int, Outbox] = {}  # tasks and stops to each worker (sent by its outbox's thread)
        pool = self.pool or (self._ray_pool() if self.opts.ray else None)
        # --ray with a server backend: one worker per node's server, on that node
        nodes = list(self.engine.engines) if hasattr(self.engine, "engines") else [None] * self.workers
        self.workers = len(nodes)
        backend_settings = self.backend.worker_settings(backends.RunContext(  # (the same for every worker)
            self.cfg, meta, imports=self.opts.imports,
            model_name=(self.engine.model_name or self.cfg.model) if self.engine is not None else "",
            staging_dir=str(getattr(self.engine, "staging_dir", ""))))
        for w, node in enumerate(nodes):
            settings = WorkerSettings(
                build_root=str(self.lay.root), data_root=str(self.lay.data), run_id=self.run_id, worker=w,
                model=self.cfg.model, aux_layers=self.cfg.aux_layers, dtype=self.cfg.dtype,
                quantize=self.cfg.quantize, device=self.opts.device or self.cfg.device, codec=self.cfg.codec, chunk_tokens=self.cfg.chunk_tokens,
                max_tokens=self.cfg.max_tokens, threads=threads, verify_after_write=self.cfg.verify_after_write,
                flood=self.cfg.watermarks.flood, min_free=self.cfg.watermarks.min_free,
                coordinator_pid=0 if pool is not None else os.getpid(),
                final_state=self.cfg.final_state, batch_tokens=self.cfg.batch_tokens,
                backend=self.backend.name, backend_settings=backend_settings,
                server_check=getattr(self.engine, "server_check", None),
                final_norm=str(self.lay.final_norm) if self.lay.final_norm.exists() else None,
                history_ordinal=self.history_ordinal)
            if node is not None:
                settings.backend_settings = self.engine.worker_settings(backend_settings, node)
                settings.server_check = self.engine.worker_check(node)
            procs[w], conns[w] = self._start_worker(ctx, settings, flags, pool, node)
            if node is not None:
                self._node_workers.setdefault(node, []).append(procs[w])
            mine = conns[w]
            outboxes[w] = Outbox(mine, f"hsbuild-worker-{w}")
        st = self._st = Dispatch(pending=deque(s.sample_id for s in plan.todo), attempts=dict(plan.attempts),
                                 assigned={w: [] for w in procs}, alive=set(procs))
        bar = self.opts.progress or NoProgress()
        bar.start(len(plan.todo), "import" if self.opts.imports is not None else "extract")
        gpus = GpuSampler(interval=5.0) if getattr(self, "gpu_build", False) else None
        # once stopping, workers still running a grace period after the stop request (or a worker's death) are
        # killed and named: a hung or SIGSTOPped worker cannot hold the run forever
        stop_since: float | None = None
        abort_since: float | None = None
        abort_grace = max(self.stop_grace, ABORT_GRACE_SECONDS)
        try:
            while st.alive:
                self._announce_stop()
                stopping = bool(self.stop_requested or self.aborted or self.refused or self.staging_too_small)
                flags.stop = stopping
                # fresh figures as soon as samples landed: a fast writer crosses `high` between two timed polls
                pause = self.space.poll(force=self._landed)
                self._landed = False
                if pause != self.paused_reason:
                    self._set_paused(pause, flags, report)
                self._engine_watch(report)
                self._drop_serverless_workers()
                stalled = self.session.stalled
                if not stopping and self.paused_reason is None and self.engine_down is None and stalled is None:
                    self._dispatch(st, outboxes, by_id, flags, report)
                for w in sorted(st.alive - st.told_to_stop):  # a sentinel once a worker has nothing more to do
                    if stopping or st.idle(w, lost_ok=pool is not None):  # its staged group: flushed on Stop
                        outboxes[w].send(Stop())
                        st.told_to_stop.add(w)
                for c in mp_connection.wait([conns[w] for w in st.alive], timeout=0.1):
                    w = next(k for k, v in conns.items() if v is c)
                    self._drain(w, c, procs[w], st, by_id, meta, bar, report)
                for w, p in procs.items():
                    if w in st.alive and not p.is_alive():
                        # read what it sent before exiting (`written`, `sealed`, `exit`) before judging it
                        self._drain(w, conns[w], p, st, by_id, meta, bar, report)
                        if w in st.alive:
                            self._worker_died(w, p.exitcode, st, report, getattr(p, "lost", None))
                now = time.monotonic()
                if self.stop_requested and stop_since is None:
                    stop_since = now
                if self.aborted and abort_since is None:
                    abort_since = now
                for since, grace in ((stop_since, self.stop_grace), (abort_since, abort_grace)):
                    if since is not None and now - since > grace:
                        self._give_up_on(st, procs, grace)
                stats = gpus.poll() if gpus else None
                if stats:
                    self.emit(Event("gpu_stats", detail=detail(devices=stats)))
                self.flush()
                if self.paused_reason is None and not stopping:  # (a cache: never while space is short)
                    self.log.maybe_checkpoint_fold()  # status and sql stay fast on a long first run
                bar.update(note=f"STALLED: {stalled.what} on {stalled.path}" if stalled else
                           f"PAUSED: {self.paused_reason}" if self.paused_reason else "")
        finally:
            flags.stop, flags.gate_open = True, True
            bar.close()
            try:
                self.flush(force=True)
                self._announce_stop()  # Ctrl-C as the loop's last turn drew the final reports: said here, once
            finally:
                stop_workers(procs, outboxes, st, SHUTDOWN_SECONDS)
                if pool is not None and pool is not self.pool:
                    pool.close()


def run_build(build: str | Path, opts: RunOptions | None = None, resume: bool = False, echo=print) -> RunReport:
    return Coordinator(build, opts, echo).run(resume=resume)
