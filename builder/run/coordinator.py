"""The coordinator: the one owner of the event log during a run.

It replays the log into a plan, starts the workers, hands them samples, commits their reports in batches,
answers live queries over its socket, pauses writers on disk watermarks, and stops at a safe point on Ctrl-C.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import threading
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
    EXIT_PREFLIGHT,
    EXIT_SAMPLES_FAILED,
    Interrupted,
    ModelError,
    SourceChangedError,
    SourceError,
    UsageError,
)
from builder.extract.source import Sample, load_source
from builder.extract.spec import check_device_spec
from builder.extract.threads import fix_threading
from builder.humanize import human_bytes, pct
from builder.layout import layout
from builder.log.events import Event, detail
from builder.log.lock import BuildLock
from builder.log.session import OwnerSession
from builder.progress import NoProgress, Progress
from builder.run.create import code_fingerprint
from builder.run.messages import (
    Abandoned,
    Deferred,
    Exit,
    Failed,
    Fatal,
    FromWorker,
    NoSpace,
    Ready,
    Sealed,
    SealFailed,
    ServerChecked,
    Skipped,
    Staged,
    Started,
    Stop,
    Task,
    Unreachable,
    WorkerSettings,
    Written,
)
from builder.run.plan import INTERRUPTED_EXTRA, Plan, make_plan
from builder.run.rebuild import adopt, unlogged
from builder.run.sizing import usable_cpus, workers_for
from builder.run.source_changes import diff_source, record_source, refusal
from builder.run.standby import Flags, Standby, start_ignoring_stop_signals, worker_entry
from builder.space.capacity import measured_bytes_per_token, project, stored_tokens
from builder.space.watermarks import SpaceMonitor
from builder.store.codec import parse_codec

if TYPE_CHECKING:  # (these import torch: only import and engine runs need them, and import them there)
    from builder.run.engine import Engine
    from builder.run.imports import DumpIndex, ImportOptions


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


class Coordinator:
    def __init__(self, build: str | Path, opts: RunOptions | None = None, echo=print):
        self.standby: Standby | None = None
        self.lay = layout(build).require()
        self.opts = opts or RunOptions()
        self.cfg = load_config(self.lay)
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
            if self.opts.ray and self.cfg.backend == "inprocess" and self.opts.imports is None:
                self.workers = 0  # one a node of the cluster, counted once connected (`_size_on_cluster`)
            else:
                count = workers_for(self.cfg, self.opts.device, importing=self.opts.imports is not None)
                self.workers, self.workers_why = count.workers, count.why
        elif not is_count(spec):
            raise UsageError(f"--workers {spec}: must be auto or at least 1")
        else:
            self.workers = spec
        self.stop_grace = _stop_grace(self.opts.stop_grace)
        if self.opts.limit is not None and self.opts.limit < 0:
            raise UsageError(f"--limit {self.opts.limit}: must be 0 or more samples")
        check_device_spec(self.opts.device or self.cfg.device)
        if self.opts.ray is not None:
            from builder.run.ray_pool import check_address, check_reachable  # noqa: PLC0415

            check_address(self.opts.ray)
            if self.opts.imports is not None:
                raise UsageError(f"--ray {self.opts.ray}: an import reads a dump's files on this node; run it "
                                 "without --ray")
            if self.cfg.backend != "inprocess" and not self.opts.launch:
                from builder.run.ray_engines import check_connect_server  # noqa: PLC0415

                check_connect_server(self.cfg.server)
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
            from builder.run.imports import check_dump, check_options  # noqa: PLC0415 - (torch: imports only)

            check_options(self.opts.imports)
            if self.opts.launch:
                raise UsageError("--launch: an import reads a dump's files; it needs no server")
            self.dump_claim = check_dump(self.opts.imports, self.lay)  # refused here: nothing touched yet
        self.dump_files: dict[str, str] = {}
        if self.opts.launch and self.cfg.backend == "inprocess":
            raise UsageError("--launch: this build's backend is inprocess (the workers load the model); --launch "
                             "starts an inference server for builds made with --backend vllm")
        self.space = SpaceMonitor(self.lay, self.cfg)
        self.paused_reason: str | None = None
        self.engine: Engine | None = None  # or RayEngines (--ray): one server per node
        self.pool = None  # the Ray worker pool (--ray), once made
        self._ray_connected = None  # a RayPool connected (to count the nodes for `auto`), not yet probed
        self._node_workers: dict[str, list] = {}  # --ray with an engine backend: node id -> its worker(s)
        self.engine_down: float | None = None  # since when the server has been unavailable
        self.engine_reason = "server_unavailable"  # or staging_full: its staging volume had no room (ENOSPC)
        self.engine_message: str | None = None  # why the engine paused the run (said by status)
        self.staging_need = 0  # bytes the staging volume must have free again (staging_full)
        self.refused: str | None = None  # the server that came back mid-run is not the build's: the run stops
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

    # -- live status ----------------------------------------------------------------------------------------
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
                **self._engine_status()}

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
            samples = load_source(self.source, _tokenizer_for(self.cfg), build=self.lay)
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

    def _standby(self) -> Standby | None:
        """The run's local workers, spawned now so that their imports overlap the source, the plan and the
        preflight (or the CLI's, spawned before the coordinator was even imported). None with --ray."""
        given = self.opts.standby
        if given is not None and (self.opts.ray or given.workers != self.workers):
            given.close()
            given = None
        if given is not None or self.opts.ray:
            return given
        return Standby(self.workers)

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
            from builder.run.imports import index_dump  # noqa: PLC0415

            report.dump = index_dump(self.opts.imports, samples, self.cfg.max_tokens, self.dump_claim)
            self.dump_files = report.dump.files
            plan.todo = [s for s in plan.todo if s.sample_id in self.dump_files][: self.opts.limit]
            done = len(self.dump_files) - len(plan.todo)  # (every file matched a source sample)
            self.echo(f"import: {report.dump.scanned} file(s) in {self.opts.imports.dir}, "
                      f"{len(self.dump_files)} sample(s) matched ({max(done, 0)} already in the build), "
                      f"{len(report.dump.problems)} file(s) unusable; {len(plan.todo)} to import now")
            dups = report.dump.duplicates
            if dups:  # harmless: the same tokens and states as the file imported
                self.echo(f"import: {len(dups)} duplicate file(s) not imported (the same tokens and states as the file "
                          f"imported): " + ", ".join(d.path for d in dups[:3]) + (" ..." if len(dups) > 3 else ""))
        if not importing and (resume or plan.done or plan.interrupted or plan.interrupted_final or plan.failed_retry
                              or plan.damaged):
            self.echo(
                f"replayed {self.log._seq} events: {plan.done} done, {len(plan.interrupted)} interrupted in flight"
                + (f" (+{len(plan.interrupted_final)} interrupted too often: given up)"
                   if plan.interrupted_final else "")
                + f", {len(plan.failed_retry) + len(plan.failed_final)} failed ({len(plan.failed_retry)} to retry), "
                f"{len(plan.damaged)} damaged (re-extract), {len(plan.pending)} never started; "
                f"{len(plan.todo)} to do now" + (f" (+{added} new in source)" if added else "")
            )
        if plan.todo:
            doc = preflight_for_run(self.lay, self.cfg, self.log, self.opts.force, {os.getpid()},
                                    # an engine backend's GPUs are the server's, not hsbuild's
                                    device=("cpu" if self.cfg.backend != "inprocess" or importing
                                            else self.opts.device or self.cfg.device), run_id=self.run_id,
                                    previous_owner=lock.previous)
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
        if self.workers_why is not None and plan.todo and (self.cfg.backend == "inprocess" or importing):
            self.echo(f"workers: {self.workers} (auto: {self.workers_why})")
        self.emit(Event("run_started", detail=detail(
            workers=self.workers, threads=self._threads(), resume=resume, plan=plan.summary(),
            **({"workers_auto": self.workers_why} if self.workers_why is not None else {}),
            config=self.cfg.to_toml(),
            config_fingerprint=self.cfg.fingerprint(), model_fingerprint=meta.get("model_fingerprint"),
            code_fingerprint=code_fingerprint(), pid=os.getpid(), previous_owner=lock.previous,
            **({"import": {"dir": str(Path(self.opts.imports.dir).absolute()), "format": self.opts.imports.format,
                           **report.dump.summary()}} if report.dump is not None else {}))))
        self.flush(force=True)
        # kept until the run has closed its log and released its lock (the session): a stop request in the run's
        # last moments is still a request, never the default action (a SIGTERM killing it mid-teardown)
        self.session.take_signals()
        try:
            if plan.todo and self.cfg.backend != "inprocess" and not importing:
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
                for ray_pool in (self.pool, self._ray_connected):  # (--ray with an engine backend: after its servers)
                    if ray_pool is not None:
                        ray_pool.close()
        left = len(self._st.pending) if getattr(self, "_st", None) is not None else 0
        if left and not self.stop_requested and not self.aborted:  # (a safety net: no worker took them)
            self.aborted = f"{left} sample(s) were left pending with no worker to take them"
        report.failed_in_build = self.log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0]
        if report.dump is not None:
            self._record_import(report)
        if self.refused:
            report.outcome, report.exit_code = "refused", EXIT_PREFLIGHT
            report.messages.append(self.refused)
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
            **({"check_errors": report.check_errors} if report.check_errors else {}))))
        self.flush(force=True)
        return report

    def _source_path(self) -> Path:
        """The source to read: --source (a moved source), else hsbuild.toml's."""
        if self.opts.source is not None:
            new = Path(self.opts.source).absolute()
            if not new.exists():
                raise UsageError(f"--source {self.opts.source}: not found; pass the path the build's source file "
                                 "now has")
            return new
        old = Path(self.cfg.source)
        if not old.exists():
            raise SourceError(str(old), f"the build's source is not there; if it moved, pass its new path: "
                              f"`hsbuild resume {self.lay.root} --source NEWPATH` (its rows must be the registered "
                              "ones, or add --accept-source-changes), else restore the file")
        return old

    def _check_source(self, samples: list[Sample]) -> int:
        """Compare the source with the registered samples: new ones are registered; changed or removed ones
        are refused, unless accepted (--accept-source-changes), then recorded. A moved source (--source) is
        recorded too, and hsbuild.toml updated. Returns how many samples were new."""
        diff = diff_source(self.log, samples)
        moved = Path(self.cfg.source).absolute() != self.source.absolute()
        if diff.needs_acceptance and not self.opts.accept_source_changes:
            err = refusal(diff, self.lay.root)
            if moved:
                err = SourceChangedError(f"--source {self.source} does not hold the build's registered samples "
                                         f"as they were ({diff.describe()}); if it is the build's source, edited, "
                                         "add --accept-source-changes; else pass the right file")
            raise err
        if moved:
            self.emit(Event("source_moved", detail=detail(source=str(self.source), previous=self.cfg.source)))
        record_source(self.log, samples, diff, self.emit, str(self.source))
        self.flush(force=True)
        if moved:  # after the log has it; only the source line changes (not this run's flag overrides)
            saved = load_config(self.lay)
            saved.source = self.cfg.source = str(self.source)
            saved.save(self.lay.config)
            self.echo(f"source moved: now {self.source} (recorded in the log; hsbuild.toml updated)")
        if diff.needs_acceptance:
            self.echo(f"source changes accepted: {diff.describe()}; changed samples are extracted again, removed "
                      "ones retired (recorded in the log: SELECT * FROM samples WHERE state = 'retired')")
        return len(diff.added)

    def _provenance(self, sid: str) -> dict:
        if sid not in self.dump_files:
            return {}
        return {"import": {"file": self.dump_files[sid], "format": self.opts.imports.format}}

    def _record_import(self, report: RunReport) -> None:
        """The `import` event: what was matched and imported, and every file that was not usable, with why."""
        self.flush(force=True)
        cols, rows = self.log.query(
            "SELECT sample_id, reason, json_extract_string(detail, '$.message') FROM events "
            "WHERE run_id = ? AND kind = 'failed' AND reason LIKE 'import_%' ORDER BY seq", [self.run_id])
        report.rejected = [{"sample_id": r[0], "reason": r[1].removeprefix("import_"), "message": r[2],
                            "path": self.dump_files.get(r[0])} for r in rows]
        d = report.dump
        self.emit(Event("import", detail=detail(
            dir=str(Path(self.opts.imports.dir).absolute()), format=self.opts.imports.format, scanned=d.scanned,
            matched=len(d.files), imported=report.written, rejected=report.rejected,
            unusable=[p.__dict__ for p in d.problems], dump_layers=d.claim.as_dict() if d.claim else None,
            **({"duplicates": [p.__dict__ for p in d.duplicates]} if d.duplicates else {}))))
        self.flush(force=True)

    def _start_engine(self, meta: dict) -> None:
        """Wait for the server (launch it with --launch), probe it, record the probe. The first probe of a build
        is its reference: a later server returning other states for the same prompt is another model."""
        if self.opts.ray:  # one server per node, each with its own worker (builder/run/ray_engines.py)
            from builder.run.ray_engines import RayEngines  # noqa: PLC0415

            self.pool = self._ray_pool()
            self.engine = RayEngines(self.pool.ray, self.pool.nodes(), self.lay, self.cfg, meta, self.opts.launch,
                                     self.echo, trust_server=self.opts.trust_server)
        else:
            from builder.run.engine import Engine, EngineOptions  # noqa: PLC0415 - (torch: engine builds only)

            self.engine = Engine(self.lay, self.cfg, meta,
                                 EngineOptions(launch=self.opts.launch, trust_server=self.opts.trust_server), self.echo)
        self.engine.start(lambda: bool(self.stop_requested))
        # the reference: the build's first probe (a re-check's or a trusted one never becomes it)
        first = self.log.query("SELECT detail FROM events WHERE kind = 'engine_probe' AND "
                               "coalesce(json_extract(detail, '$.recheck')::BOOLEAN, false) = false ORDER BY seq "
                               "LIMIT 1")[1]
        recorded = json.loads(first[0][0]) if first and first[0][0] else None
        from builder.run.engine import EngineRefused  # noqa: PLC0415

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

    def _engine_unavailable(self, message: str, report: RunReport, need_bytes: int = 0) -> None:
        """Pause dispatch: the server is gone (server_unavailable) or its staging volume is full (staging_full:
        `need_bytes` free again resumes it). Neither is the samples' fault."""
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
        from builder.extract.backends.vllm import volume_room  # noqa: PLC0415

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

    def _adopt_unlogged(self, previous: dict | None = None) -> None:
        """Samples durable in a segment (its manifest says so) whose `written` event the log lacks: a crash
        between the data barrier and the log commit, or a log that lost commits. Adopt them once their bytes
        check out, rather than extracting them again."""
        missed = unlogged(self.log, self.lay.data)
        if not missed:
            return
        rep = adopt(self.log, self.lay.data, self.emit, missed)
        self.emit(Event("adopted", detail=detail(found=len(missed), adopted=len(rep.adopted), damaged=rep.damaged,
                                                 stale=rep.stale)))
        self.flush(force=True)
        why = ("the previous run was interrupted (Ctrl-C twice) before its log committed them"
               if previous and previous.get("interrupted") else "a crash before the log's commit, or a lost log file")
        self.echo(f"the log was behind the data: {len(missed)} durable sample(s) had no `written` event ({why}); "
                  f"adopted {len(rep.adopted)} after reading them back"
                  + (f"; {len(rep.damaged)} failed the check and are extracted again" if rep.damaged else ""))

    def _give_up_interrupted(self, plan: Plan) -> None:
        """Record the samples left in flight too often as failed, with the reason, so `status`, the `samples`
        view and later plans show why they are no longer tried."""
        limit = self.cfg.max_attempts + INTERRUPTED_EXTRA
        for sid in plan.interrupted_final:
            n = plan.attempts[sid]
            self.emit(Event("failed", sample_id=sid, attempt=n, reason="interrupted_too_often", detail=detail(
                attempts=n, limit=limit, message=(
                    f"started {n} times without being written, the last time left in flight by a run that ended "
                    f"abruptly (crash, OOM kill, kill -9); given up at {limit} starts (--max-attempts + "
                    f"{INTERRUPTED_EXTRA}): find what kills the run on this sample, or raise --max-attempts to try "
                    "it again"))))
        if plan.interrupted_final:
            self.echo(f"given up on {len(plan.interrupted_final)} sample(s) interrupted too often (e.g. "
                      f"{', '.join(plan.interrupted_final[:3])}): started {limit} times or more, left in flight by "
                      "runs that ended abruptly; recorded as failed (interrupted_too_often)")

    def _size_on_cluster(self) -> None:
        """`--workers auto` with --ray: one worker a live node of the cluster (connecting to it now; the nodes'
        preflight comes with the pool, after `run_started`)."""
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        self._ray_connected = RayPool(self.opts.ray, RAY_CPUS_PER_WORKER)
        nodes = len(self._ray_connected.nodes())
        self.workers = max(1, nodes)
        self.workers_why = f"one a live node of the Ray cluster, {nodes} (--workers N for more)"

    def _threads(self) -> int:
        """Intra-op threads of each worker. Recorded in `run_started`: on the CPU, a forward pass's last bits can
        depend on how its reductions were split, so the same sample extracted with another thread count may
        differ by an ulp (both are the model's output; a bit-exact comparison must use the same count). A Ray
        worker gets the CPUs its actor reserves (RAY_CPUS_PER_WORKER)."""
        if self.opts.ray:
            return max(1, int(RAY_CPUS_PER_WORKER))
        return max(1, usable_cpus() // max(1, self.workers))

    def _start_worker(self, ctx, settings: WorkerSettings, flags: Flags, pool, node: str | None = None) -> tuple:
        """A worker: a local process (spawned, its stop signals ignored), or an actor on the Ray cluster whose
        handle looks like one (builder/run/ray_pool.py). Returns (process, the coordinator's end of its pipe)."""
        if pool is not None:
            handle = pool.start(settings, flags, settings.worker, node=node)
            pl = handle.placement
            self.emit(Event("worker_placed", worker=settings.worker,
                            detail=detail(node=pl.node_id, host=pl.host, pid=pl.pid)))
            self.echo(f"worker {settings.worker}: Ray actor on node {pl.node_id[:12]} ({pl.host}, pid {pl.pid})")
            return handle, handle.conn
        ready = self.standby.take(settings.worker, settings) if self.standby is not None else None
        if ready is not None:
            return ready
        mine, theirs = ctx.Pipe(duplex=True)
        p = ctx.Process(target=worker_entry, args=(settings, theirs, flags), daemon=True,
                        name=f"hsbuild-worker-{settings.worker}")
        start_ignoring_stop_signals(p)  # (starts it)
        theirs.close()  # so a dead worker's pipe reads as EOF here
        return p, mine

    def _ray_pool(self):
        """The Ray cluster's worker pool (--ray), after checking every node sees the build directory."""
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        pool, self._ray_connected = self._ray_connected or RayPool(self.opts.ray, RAY_CPUS_PER_WORKER), None
        # an engine backend's GPUs are the servers', not hsbuild's (as in the local preflight)
        device = self.opts.device or self.cfg.device if self.cfg.backend == "inprocess" else "cpu"
        problems, warnings = pool.probe(self.lay.root, self.run_id, device)
        for w in warnings:
            self.echo(f"warning: {w}")
        if problems:
            pool.close()
            raise UsageError(f"--ray {self.opts.ray}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.emit(Event("nodes_probed", detail=detail(nodes=[n["NodeID"] for n in pool.nodes()])))
        return pool

    def _extract(self, plan: Plan, by_id: dict[str, Sample], meta: dict, report: RunReport) -> None:
        if self.opts.imports is not None:
            from builder.extract.backends.dump import DumpSettings  # noqa: PLC0415
        if self.engine is not None:
            from builder.run.engine import vllm_settings  # noqa: PLC0415
        ctx = mp.get_context("spawn")
        fix_threading()  # inherited by the spawned workers before their first forward pass
        # the standby workers hold the run's flags since they were spawned
        flags = self.standby.flags if self.standby is not None else Flags(ctx)
        threads = self._threads()
        procs: dict[int, mp.process.BaseProcess] = {}
        conns: dict[int, Connection] = {}  # reports from each worker (read here)
        outboxes: dict[int, _Outbox] = {}  # tasks and stops to each worker (sent by its outbox's thread)
        pool = self.pool or (self._ray_pool() if self.opts.ray else None)
        # --ray with an engine backend: one worker per node's server, on that node
        nodes = list(self.engine.engines) if hasattr(self.engine, "engines") else [None] * self.workers
        self.workers = len(nodes)
        for w, node in enumerate(nodes):
            settings = WorkerSettings(
                build_root=str(self.lay.root), data_root=str(self.lay.data), run_id=self.run_id, worker=w,
                model=self.cfg.model, aux_layers=self.cfg.aux_layers, dtype=self.cfg.dtype,
                quantize=self.cfg.quantize, device=self.opts.device or self.cfg.device, codec=self.cfg.codec, chunk_tokens=self.cfg.chunk_tokens,
                max_tokens=self.cfg.max_tokens, threads=threads, verify_after_write=self.cfg.verify_after_write,
                flood=self.cfg.watermarks.flood, min_free=self.cfg.watermarks.min_free,
                coordinator_pid=0 if pool is not None else os.getpid(),
                final_state=self.cfg.final_state, batch_tokens=self.cfg.batch_tokens,
                vllm=(vllm_settings(self.cfg, meta, self.engine.model_name or self.cfg.model,
                                    getattr(self.engine, "staging_dir", ""))
                      if self.engine is not None else None),
                server_check=getattr(self.engine, "server_check", None),
                dump=(DumpSettings(self.opts.imports.format, int(meta["hidden_size"]), len(self.cfg.aux_layers or
                                   meta["aux_layers"]), self.cfg.dtype, self.cfg.final_state,
                                   self.opts.imports.final_state) if self.opts.imports is not None else None),
                final_norm=str(self.lay.final_norm) if self.lay.final_norm.exists() else None)
            if node is not None:
                settings.vllm = self.engine.worker_vllm(settings.vllm, node)
                settings.server_check = self.engine.worker_check(node)
            procs[w], conns[w] = self._start_worker(ctx, settings, flags, pool, node)
            if node is not None:
                self._node_workers.setdefault(node, []).append(procs[w])
            mine = conns[w]
            outboxes[w] = _Outbox(mine, f"hsbuild-worker-{w}")
        st = self._st = _Dispatch(pending=deque(s.sample_id for s in plan.todo), attempts=dict(plan.attempts),
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
                stopping = bool(self.stop_requested or self.aborted or self.refused)
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
                _stop_workers(procs, outboxes, st, SHUTDOWN_SECONDS)
                if pool is not None and pool is not self.pool:
                    pool.close()

    def _dispatch(self, st: _Dispatch, outboxes: dict, by_id: dict[str, Sample], flags: Flags,
                  report: RunReport) -> None:
        """Hand out samples: PER_WORKER to each ready worker (one in hand, one waiting), more while they are small
        (up to QUEUE_SAMPLES and QUEUE_TOKENS queued), so a worker always has its next sample at hand and can
        group many small ones into one durable write."""
        for w in sorted(st.ready & st.alive - st.told_to_stop, key=lambda k: len(st.assigned[k])):
            while st.pending and (len(st.assigned[w]) < st.window.get(w, PER_WORKER) or (
                    len(st.assigned[w]) < QUEUE_SAMPLES
                    and sum(by_id[x].num_tokens for x in st.assigned[w]) + by_id[st.pending[0]].num_tokens
                    <= QUEUE_TOKENS)):
                pause = self.space.poll(force=True)  # fresh figures before every dispatch
                if pause is not None:
                    self._set_paused(pause, flags, report)
                    return
                sid = st.pending.popleft()
                s = by_id[sid]
                st.assigned[w].append(sid)
                outboxes[w].send(Task(sid, st.attempts.get(sid, 0) + 1, s.fingerprint, s.input_ids, s.loss_mask,
                                     self.dump_files.get(sid)))

    def _set_paused(self, reason: str | None, flags: Flags, report: RunReport) -> None:
        figures = self.space.snapshot()
        if reason is not None:
            flags.gate_open = False
            report.pauses += 1
            self.emit(Event("paused", reason=reason, detail=detail(**figures)))
            self.echo(f"\nPAUSED ({reason}): {self.space.describe()}; resumes by itself below the low watermark")
        else:
            flags.gate_open = True
            self.emit(Event("resumed", reason=self.paused_reason, detail=detail(**figures)))
            self.echo(f"\nresumed: {self.space.describe()}")
        self.paused_reason = reason
        self.flush(force=True)

    def _handle(self, msg: FromWorker, st: _Dispatch, by_id, meta, bar, report) -> None:
        wid = msg.worker
        match msg:
            case Ready(fingerprint=fp):
                st.ready.add(wid)
                if msg.device.startswith("cuda"):
                    self.echo(f"worker {wid}: on {msg.device}")
                st.window[wid] = max(PER_WORKER, msg.capacity + 1)  # all its requests in flight, one waiting
                if meta.get("model_fingerprint") and fp != meta["model_fingerprint"]:
                    self.stop_requested = max(self.stop_requested, 1)
                    raise ModelError(
                        f"model fingerprint {fp} differs from the build's {meta['model_fingerprint']}: the model "
                        "changed since `init`; restore it, or start a new build with `hsbuild init --force`"
                    )
            case Fatal(error=error):
                raise ModelError(f"worker {wid} could not start: {error}")
            case Started(sample_id=sid, attempt=attempt, fingerprint=fp):
                st.current[wid] = sid
                st.in_flight.add(sid)
                st.attempts[sid] = attempt
                self.emit(Event("started", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                detail=detail(origin="import") if sid in self.dump_files else None))
            case Staged(sample_id=sid):
                st.stage(wid, sid)
            case Unreachable(sample_id=sid, attempt=attempt, fingerprint=fp, message=message, refused=refused,
                             need_bytes=need):
                # the engine's failure, not the sample's: back to pending, not counted against --max-attempts
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                reason="server_unavailable", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)
                if refused:
                    self._server_refused(message)
                else:
                    self._engine_unavailable(message, report, need)
            case ServerChecked(found=found):
                self.emit(Event("engine_probe", worker=wid, detail=detail(
                    server=self.engine.server if self.engine is not None else None, recheck=True, **found)))
                self.flush(force=True)
            case Written(sample_id=sid, attempt=attempt, fingerprint=fp, location=loc):
                self._landed = True
                self.emit(Event("written", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                nbytes=loc.nbytes, checksums=json.dumps(loc.checksums, sort_keys=True),
                                detail=detail(truncated=msg.truncated, seconds=round(msg.seconds, 4),
                                              disk_bytes=loc.disk_bytes, **self._provenance(sid),
                                              **_quant_error(loc))))
                if msg.verified:
                    self.emit(Event("verified", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                    segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                    detail=detail(mode="after_write")))
                elif msg.check_error is not None:  # could not be read back: written, not checked (no state change)
                    self.emit(Event("check_error", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                    segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                    reason="check_error", detail=detail(mode="after_write", message=msg.check_error)))
                    report.check_errors += 1
                st.done(wid, sid)
                report.written += 1
                self.space.account(loc.nbytes, loc.num_tokens)
                bar.update(1, loc.num_tokens, loc.nbytes)
            case Failed(sample_id=sid, attempt=attempt, fingerprint=fp, reason=reason, message=message):
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, reason=reason,
                                detail=detail(message=message)))
                st.done(wid, sid)
                report.failed += 1
                bar.update(1)
            case NoSpace(sample_id=sid, attempt=attempt, fingerprint=fp, message=message):
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                reason="no_space", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)  # retried once space returns
                self.space.disk_full()
            case Deferred(sample_id=sid, projected=projected):
                room = self.space.never_fits(projected, msg.total, msg.free)
                if room is None:  # waits until it fits
                    st.done(wid, sid, requeue=True)
                    self.space.flood_block(projected)
                    return
                wm = self.cfg.watermarks
                message = (f"needs {projected} bytes ({human_bytes(projected)}, uncompressed upper bound) but the "
                           f"volume of {self.lay.data} ({human_bytes(msg.total)}) has room for only {room} bytes "
                           f"({human_bytes(room)}) below the flood watermark ({pct(wm.flood)})"
                           + (f" and min_free ({human_bytes(wm.min_free)})" if wm.min_free else "")
                           + " besides the other files on it, even without this build's data; it can never be "
                           "written there: grow or clean the volume, raise --flood, or lower --max-tokens")
                self.emit(Event("failed", sample_id=sid, fingerprint=msg.fingerprint, attempt=msg.attempt,
                                worker=wid, reason="too_big_for_volume",
                                detail=detail(message=message, projected=projected, room=room)))
                self.echo(f"\nsample {sid} failed: too big for the volume: {message}")
                st.done(wid, sid)
                report.failed += 1
                bar.update(1)
            case Skipped(sample_id=sid) | Abandoned(sample_id=sid):
                st.done(wid, sid, requeue=not self.stop_requested)
            case Sealed(info=info):
                self.emit(Event("segment_sealed", worker=wid, segment=info["segment"], num_tokens=info["tokens"],
                                detail=detail(**info)))
            case SealFailed(segment=segment, error=error):
                self.emit(Event("segment_sealed", worker=wid, segment=segment, reason="seal_failed",
                                detail=detail(error=error)))
            case Exit():
                st.alive.discard(wid)

    def _drain(self, w: int, conn: Connection, proc, st: _Dispatch, by_id, meta, bar, report) -> None:
        """Handle every message the worker has sent so far, in order. At EOF (its end of the pipe is closed: the
        process is gone) a worker that never said `exit` died."""
        while w in st.alive:
            try:
                if not conn.poll(0):
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                proc.join(timeout=5)
                self._worker_died(w, proc.exitcode, st, report, getattr(proc, "lost", None))
                return
            self._handle(msg, st, by_id, meta, bar, report)

    @staticmethod
    def _take_back(w: int, st: _Dispatch, keep: str | None = None) -> list[str]:
        """Worker `w` is gone: out of the dispatch, and every sample it held (queued to it, in hand, or staged in
        its group and never made durable) back to the front of pending, in order, except `keep`. Returns them."""
        st.alive.discard(w)
        st.current.pop(w, None)
        held = list(dict.fromkeys([*st.assigned.pop(w, []), *st.staged.pop(w, [])]))
        st.assigned[w] = []
        st.in_flight.difference_update(held)
        back = [sid for sid in held if sid != keep]
        st.pending.extendleft(reversed(back))
        return back

    def _worker_lost(self, w: int, why: str, st: _Dispatch) -> None:
        in_hand = st.current.get(w)
        back = self._take_back(w, st)  # its sample in hand too: not the sample's fault, retried without limit
        if in_hand is not None:
            self.emit(Event("failed", sample_id=in_hand, attempt=st.attempts.get(in_hand), worker=w,
                            reason="worker_lost", detail=detail(message=why)))
        self.emit(Event("worker_lost", worker=w, detail=detail(message=why, requeued=len(back))))
        left = len(st.alive - st.told_to_stop)  # (a worker told to stop takes no more samples)
        self.echo(f"\nworker {w} lost ({why}); its {len(back)} sample(s) go back to pending; {left} worker(s) go on")
        if not left and st.pending:
            self.aborted = ("every Ray worker is gone" if not st.alive else
                            "no Ray worker is left to take the lost worker's samples")
            self.echo("stopping the run at a safe point; `hsbuild resume` continues")

    def _give_up_on(self, st: _Dispatch, procs: dict[int, mp.process.BaseProcess], grace: float) -> None:
        """Workers that did not stop within the grace period (hung, or frozen by SIGSTOP) are killed and named.
        The sample in hand stays `started` for `resume` (not charged a failure); queued ones go back to pending."""
        for w in sorted(st.alive):
            p = procs[w]
            in_hand = st.current.get(w)
            self.echo(f"\nworker {w} (pid {p.pid}) did not stop within {grace:g} s; killing it (still safe)"
                      + (f"; its sample {in_hand} is left for `hsbuild resume`, not counted as failed"
                         if in_hand else "; it held no sample"))
            p.kill()
            p.join(timeout=5)
            self._take_back(w, st, keep=in_hand)

    def _worker_died(self, w: int, code: int | None, st: _Dispatch, report: RunReport,
                     lost: str | None = None) -> None:
        """Its sample in hand failed (`worker_died`); samples only queued to it go back to pending; the run stops.
        A Ray worker that was `lost` (its node or actor gone, not its sample's fault): everything it held goes
        back to pending (`worker_lost`, retried without limit) and the run goes on with the others."""
        if lost is not None:
            self._worker_lost(w, lost, st)
            return
        in_hand = st.current.get(w)
        self.echo(f"\nworker {w} died (exit code {code})" + (f" while on sample {in_hand}" if in_hand else ""))
        held = in_hand is not None and in_hand in st.assigned.get(w, [])
        self._take_back(w, st, keep=in_hand)
        if held:
            self.emit(Event("failed", sample_id=in_hand, attempt=st.attempts.get(in_hand), worker=w,
                            reason="worker_died", detail=detail(exitcode=code)))
            report.failed += 1
        self.aborted = f"worker {w} died (exit code {code})"
        self.echo("stopping the run at a safe point; `hsbuild resume` continues")


RAY_CPUS_PER_WORKER = float(os.environ.get("HSBUILD_RAY_CPUS", "1"))  # CPUs a Ray worker's actor reserves
HUNG_SECONDS = float(os.environ.get("HSBUILD_SERVER_HUNG", "60"))  # an engine's server silent this long is hung
PER_WORKER = 2  # samples handed to a worker at once: one in hand, one waiting ...
QUEUE_SAMPLES = 64  # ... or more, while small: up to this many
QUEUE_TOKENS = 8192  # ... holding at most this many tokens
STOP_GRACE_SECONDS = 30.0  # after Ctrl-C/SIGTERM, how long workers get to finish their sample (HSBUILD_STOP_GRACE)
ABORT_GRACE_SECONDS = 120.0  # after a worker died, how long the others get
SHUTDOWN_SECONDS = 10.0  # leaving the main loop early (an error): how long all workers together get to exit


def _quant_error(loc) -> dict:
    """The written event's `fp8_error` (an fp8 build: each state field's relative RMS error), else nothing."""
    if not loc.quant_error:
        return {}
    return {"fp8_error": {k: round(v, 6) for k, v in loc.quant_error.items()}}


def _stop_workers(procs: dict[int, mp.process.BaseProcess], outboxes: dict[int, _Outbox], st: _Dispatch,
                  seconds: float) -> None:
    """Tell every worker still running to stop, then join them all within one shared deadline; kill the rest
    (safe: nothing they have not reported is referenced)."""
    for w, p in procs.items():
        if w not in st.told_to_stop and p.is_alive():
            outboxes[w].send(Stop())
            st.told_to_stop.add(w)
    deadline = time.monotonic() + seconds
    for p in procs.values():
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for w, p in procs.items():
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        outboxes[w].close()  # its thread ends (a send to a dead worker fails), then the pipe is closed


@dataclass
class _Dispatch:
    """Who has which sample. Exact per worker, so a dead worker's samples are never lost track of."""

    pending: deque
    attempts: dict[str, int]
    assigned: dict[int, list[str]]  # handed to the worker, not yet reported back, in order
    alive: set[int]
    ready: set[int] = field(default_factory=set)
    current: dict[int, str] = field(default_factory=dict)  # the sample a worker announced `started`
    told_to_stop: set[int] = field(default_factory=set)
    staged: dict[int, list[str]] = field(default_factory=dict)  # extracted, in the worker's unflushed group
    window: dict[int, int] = field(default_factory=dict)  # samples a worker may hold (its backend's capacity + 1)
    in_flight: set[str] = field(default_factory=set)  # started, not yet staged or done

    def idle(self, w: int, lost_ok: bool = False) -> bool:
        """Nothing left for worker `w`: none pending, none handed to it. Where a lost worker's samples go back
        to pending and the run goes on (`lost_ok`: Ray), an idle worker also waits until no other worker still
        holds samples to extract: stopped early, it could not take back a lost node's samples."""
        if self.pending or self.assigned.get(w):
            return False
        return not lost_ok or not any(self.assigned.get(x) for x in self.alive if x != w)

    def stage(self, w: int, sid: str) -> None:
        """The worker holds `sid` in its group (not durable): it no longer counts against PER_WORKER."""
        if sid in self.assigned.get(w, []):
            self.assigned[w].remove(sid)
        if self.current.get(w) == sid:
            del self.current[w]
        self.staged.setdefault(w, []).append(sid)
        self.in_flight.discard(sid)

    def done(self, w: int, sid: str, requeue: bool = False) -> None:
        if sid in self.assigned.get(w, []):
            self.assigned[w].remove(sid)
        if sid in self.staged.get(w, []):
            self.staged[w].remove(sid)
        if self.current.get(w) == sid:
            del self.current[w]
        self.in_flight.discard(sid)
        if requeue:
            self.pending.appendleft(sid)


class _Outbox:
    """Messages to one worker, sent by their own thread in order: a worker that stops reading (SIGSTOPped, hung)
    fills its pipe and blocks that thread, never the main loop, which still handles Ctrl-C, reports and the
    stop grace (that kills such a worker, and the blocked send then fails)."""

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"{name}-outbox", daemon=True)
        self.thread.start()

    def send(self, obj: object) -> None:
        self.queue.put(obj)

    def _run(self) -> None:
        while (obj := self.queue.get()) is not None:
            try:
                self.conn.send(obj)
            except (BrokenPipeError, OSError, ValueError):
                return  # the worker is gone; the main loop notices and accounts for its samples

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (once its worker is gone, a blocked send fails), then close the pipe."""
        self.queue.put(None)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.conn.close()


def _stop_grace(value: float | None) -> float:
    if value is None:
        raw = os.environ.get("HSBUILD_STOP_GRACE")
        if not raw:
            return STOP_GRACE_SECONDS
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"HSBUILD_STOP_GRACE={raw!r}: not a number of seconds") from None
    if not value >= 0:
        raise UsageError(f"stop grace {value}: must be 0 or more seconds")
    return float(value)


def _tokenizer_for(cfg):
    from builder.extract.spec import BuiltinSpec, HfTokenizer, builtin_tokenizer, is_builtin  # noqa: PLC0415

    if is_builtin(cfg.model):
        return builtin_tokenizer(BuiltinSpec.parse(cfg.model).vocab)
    return HfTokenizer(Path(cfg.model))  # loaded at its first use: sources of input_ids never need it


def run_build(build: str | Path, opts: RunOptions | None = None, resume: bool = False, echo=print) -> RunReport:
    return Coordinator(build, opts, echo).run(resume=resume)
