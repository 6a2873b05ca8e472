"""The coordinator: the one owner of the event log during a run.

It replays the log into a plan, starts the workers, hands them samples, commits their reports in batches,
answers live queries over its socket, pauses writers on disk watermarks, and stops at a safe point on Ctrl-C.

A run is composed of parts, each an object that owns its state and is called with what it needs (docs/design.md,
section 10): the start decided once (`preparation.prepare`: a frozen `Prepared`), the workers (`spawning.Workers`),
the log caught up before the loop (`catchup.CatchUp`), who holds which sample (`dispatch.Dispatcher`), the workers'
reports turned into events (`handling.Reports`), the engine (`supervision.Supervisor`), the pause on the disk
watermarks and what `status` gets (`status`). This module holds the run itself: `run_build`, `RunReport`, and the
Coordinator, the order of its steps and its main loop.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import require_same_format
from builder.doctor.gpu import GpuSampler
from builder.doctor.report import preflight_for_run, warning_lines
from builder.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SAMPLES_FAILED, Interrupted
from builder.extract import source as sources
from builder.extract.backends.registry import RunContext
from builder.extract.spec import BuiltinSpec, HfTokenizer, builtin_tokenizer, is_builtin
from builder.log.events import Event, detail
from builder.log.session import OwnerSession
from builder.progress import Echo, NoProgress, quiet
from builder.run.catchup import CatchUp
from builder.run.create import code_fingerprint
from builder.run.dispatch import Dispatcher
from builder.run.handling import Imported, Reports, Tally
from builder.run.messages import WorkerSettings
from builder.run.plan import Plan, make_plan
from builder.run.preparation import Prepared, RunOptions, prepare
from builder.run.regenerate import RegenSettings
from builder.run.settled import source_stat
from builder.run.spawning import Workers
from builder.run.status import SpacePause, live_status
from builder.run.supervision import Supervisor, first_probe
from builder.space.capacity import measured_bytes_per_token, response_allowance, stored_tokens
from builder.space.watermarks import SpaceMonitor
from builder.store.codec import parse_codec
from builder.store.history import next_ordinal

if TYPE_CHECKING:  # (these import torch: only import and engine runs need them, and import them there)
    from builder.exchange.imports import DumpIndex

ABORT_GRACE_SECONDS = 120.0  # after a worker died, how long the others get to finish their sample
SHUTDOWN_SECONDS = 10.0  # leaving the main loop early (an error): how long all workers together get to exit


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
    at_token_limit: int = 0  # a regenerating build: responses that stopped at the token limit, kept
    dropped: int = 0  # ... retired instead (--drop-truncated)


class Coordinator:
    """A run: see the module's docstring. `prep`: its start (`prepare`); `echo`: where it says things."""

    def __init__(self, prep: Prepared, echo: Echo = quiet):
        self.prep = prep
        self.echo = echo
        self.run_id = uuid.uuid4().hex
        self._space = SpaceMonitor(prep.lay, prep.cfg)
        self._session: OwnerSession | None = None  # the owner session, once the build lock is held (`run`)
        self._meta: dict | None = None  # the build's metadata, once the log is open
        self._workers: Workers | None = None
        self._engine: Supervisor | None = None
        self._pause: SpacePause | None = None
        self._dispatch: Dispatcher | None = None
        self._reports: Reports | None = None
        self._source_stat: dict | None = None  # the source's identity as read (`settled.source_stat`)

    @property
    def space(self) -> SpaceMonitor:
        """The run's disk-space monitor: its watermarks, its ballast, the figures `status` projects from."""
        return self._space

    def status(self) -> dict:
        """What `status` gets while the run goes on (asked from the session's query thread once the log is open)."""
        workers, dispatch, pause = self._workers, self._dispatch, self._pause
        return live_status(self.run_id, workers.count if workers is not None else self.prep.workers,
                           self._session.log, self._space, self._meta, pause.reason if pause is not None else None,
                           self._engine, dispatch.in_flight() if dispatch is not None else 0, bool(self.prep.opts.ray))

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunReport:
        prep = self.prep
        staging = [Path(prep.cfg.staging)] if prep.cfg.staging and Path(prep.cfg.staging).is_dir() else []
        session = OwnerSession(prep.lay, "run", self.run_id, take_over=prep.opts.take_over, echo=self.echo,
                               status=self.status, before_commit=self._space.before_commit, watch=staging,
                               metrics=prep.opts.metrics)
        try:
            session.__enter__()  # the build lock; `status` answers from now on (the phase)
        except BaseException:
            if prep.standby is not None:
                prep.standby.close()
            raise
        self._session = session
        try:
            self._workers = Workers(prep, self.run_id, session, self.echo)  # spawned now: imports overlap ours
            catch = CatchUp(prep, session, self.echo)
            # validate the source before the log is even opened: bad input changes nothing
            session.phase = "starting: reading the source"
            source = catch.source_path()
            stat = source_stat(source)  # (before reading: a write while it is read makes it another file)
            tokenizer = tokenizer_for(prep.cfg)
            samples = sources.load_source(source, tokenizer, build=prep.lay, regenerate=prep.cfg.turns_read())
            # the file's identity, recorded in run_started: a later resume with nothing to do is answered from the
            # log (run/settled.py); not where a model directory's tokenizer made the tokens (its files count too)
            self._source_stat = None if isinstance(tokenizer, HfTokenizer) and tokenizer.loaded else stat
            session.phase = "starting: replaying the log"
            # (the signals are taken once the run has started: Ctrl-C before that ends it at once)
            session.open(signals=False)
            return self._run_locked(catch, resume, source, samples)
        finally:
            try:
                if self._workers is not None:
                    self._workers.close()  # the workers not taken (nothing to do, a refusal, an error)
            finally:
                session.close()  # the log closed, the lock released, and only then the signals given back

    def _run_locked(self, catch: CatchUp, resume: bool, source: Path, samples: list[sources.Sample]) -> RunReport:
        session, log, workers = self._session, self._session.log, self._workers
        previous = session.lock.previous
        meta = self._meta = log.meta()
        require_same_format(self.prep.cfg, meta)  # never overridable: a build holds one format
        parse_codec(self.prep.cfg.codec)  # a build made before init checked codec levels: refused here, not per sample
        added, moved = catch.check_source(source, samples)
        if moved:
            self.prep = self.prep.moved_to(source)
        prep = self.prep
        catch.adopt_unlogged(previous)
        catch.adopt_drops()
        plan = make_plan(log, samples, prep.cfg.max_attempts, None if prep.importing else prep.opts.limit)
        report = RunReport(self.run_id, plan)
        if prep.importing:
            report.dump = catch.match_dump(plan, samples)
        else:
            catch.say_replayed(plan, resume, added)
        gpu_build = False
        if plan.todo:
            doc = preflight_for_run(prep.lay, prep.cfg, log, prep.opts.force, {os.getpid()},
                                    # a server backend's GPUs are the server's, not hsbuild's
                                    device=prep.compute_device, run_id=self.run_id, previous_owner=previous)
            gpu_build = doc.gpu_build
            for line in warning_lines(doc):
                self.echo(line)
        self._space.preflight(stored_tokens(plan.todo, prep.cfg.max_tokens, response_allowance(log, meta)), meta,
                              measured_bytes_per_token(log),
                              allow_overcommit=prep.opts.allow_overcommit, echo=self.echo,
                              remaining_samples=len(plan.todo))
        catch.give_up_interrupted(plan)
        if workers.count == 0 and plan.todo:  # --ray, auto: counted on the cluster
            workers.size_on_cluster()
        workers.at_least_one()  # (nothing to do: no cluster asked)
        if workers.why is not None and plan.todo and not prep.backend.server:
            self.echo(f"workers: {workers.count} (auto: {workers.why})")
        # the ordinal this run's segments take in the build's history (data/history/): taken now, under the lock;
        # its record is written before the first segment (SegmentWriter.run_record), like any of its data
        ordinal = next_ordinal(prep.lay.data)
        session.emit(Event("run_started", detail=detail(
            workers=workers.count, threads=prep.threads, resume=resume, plan=plan.summary(),
            **({"workers_auto": workers.why} if workers.why is not None else {}),
            config=prep.cfg.to_toml(),
            config_fingerprint=prep.cfg.fingerprint(), model_fingerprint=meta.get("model_fingerprint"),
            code_fingerprint=code_fingerprint(), pid=os.getpid(), previous_owner=previous,
            history_ordinal=ordinal, **({"source_stat": self._source_stat} if self._source_stat is not None else {}),
            **({"import": {"dir": str(Path(prep.opts.imports.dir).absolute()), "format": prep.opts.imports.format,
                           **report.dump.summary()}} if report.dump is not None else {}))))
        session.flush(force=True)
        # kept until the run has closed its log and released its lock (the session): a stop request in the run's
        # last moments is still a request, never the default action (a SIGTERM killing it mid-teardown)
        session.take_signals()
        engine = self._engine = Supervisor(prep, session, self.echo)
        try:
            if plan.todo and prep.backend.server:
                try:
                    engine.start(meta, first_probe(log), workers.ray_pool() if prep.opts.ray else None)
                except Interrupted:  # Ctrl-C while waiting for the server: a stop like any other (exit 130)
                    session.request_stop()
                    session.announce_stop()
            if plan.todo and not session.stop_requested:
                self._extract(plan, meta, report.dump, ordinal, gpu_build)
        except BaseException as e:
            session.emit(Event("run_finished", reason="error", detail=detail(error=f"{type(e).__name__}: {e}")))
            session.flush(force=True)
            raise
        finally:
            try:
                engine.stop()
            finally:
                workers.close()  # (--ray with a server backend: the cluster after its servers)
        self._finish(catch, report)
        return report

    def _finish(self, catch: CatchUp, report: RunReport) -> None:
        """The run's outcome, said and committed (`run_finished`)."""
        session, engine = self._session, self._engine
        reports = self._reports
        tally = reports.tally if reports is not None else Tally()
        report.written, report.failed, report.check_errors = tally.written, tally.failed, tally.check_errors
        report.at_token_limit, report.dropped = tally.at_token_limit, tally.dropped
        report.pauses = (self._pause.pauses if self._pause is not None else 0) + engine.pauses
        aborted = reports.aborted if reports is not None else None
        left = self._dispatch.pending() if self._dispatch is not None else 0
        if left and not session.stop_requested and not aborted:  # (a safety net: no worker took them)
            aborted = f"{left} sample(s) were left pending with no worker to take them"
        report.failed_in_build = session.log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0]
        if report.dump is not None:
            report.rejected = catch.record_import(self.run_id, report.dump, report.written)
        stopped = engine.stop_reason()
        if stopped is not None:  # the engine's side stopped the run (supervision.py)
            report.outcome, report.exit_code = stopped.outcome, stopped.exit_code
            report.messages.append(stopped.message)
        elif session.stop_requested:
            report.outcome, report.exit_code = "interrupted", EXIT_INTERRUPTED
        elif aborted:
            report.outcome, report.exit_code = "worker_died", EXIT_SAMPLES_FAILED
            report.messages.append(aborted)
        elif report.failed_in_build:
            report.exit_code = EXIT_SAMPLES_FAILED
        if report.check_errors:
            self.echo(f"{report.check_errors} sample(s) written but not checked: --verify-after-write could not read "
                      f"them back (an I/O error, not a mismatch; they stay written); check them with: "
                      f"hsbuild verify {self.prep.lay.root}")
        if report.at_token_limit or report.dropped:
            self.echo(cut_off_line(report, self.prep.cfg, self.prep.lay.root))
        too_small = engine.too_small_message()
        session.emit(Event("run_finished", reason=report.outcome, detail=detail(
            written=report.written, failed=report.failed, pauses=report.pauses,
            failed_in_build=report.failed_in_build,
            **({"check_errors": report.check_errors} if report.check_errors else {}),
            **({"at_token_limit": report.at_token_limit} if report.at_token_limit else {}),
            **({"dropped_at_token_limit": report.dropped} if report.dropped else {}),
            **({"message": too_small} if too_small else {}))))
        session.flush(force=True)

    def _settings(self, w: int, meta: dict, backend_settings: object, node: str | None, ordinal: int) -> WorkerSettings:
        """Worker `w`'s settings (on Ray with a server backend: pointed at node `node`'s server)."""
        prep, engine = self.prep, self._engine
        cfg = prep.cfg
        return WorkerSettings(
            build_root=str(prep.lay.root), data_root=str(prep.lay.data), run_id=self.run_id, worker=w,
            model=cfg.model, aux_layers=cfg.aux_layers, dtype=cfg.dtype, quantize=cfg.quantize, device=prep.device,
            codec=cfg.codec, chunk_tokens=cfg.chunk_tokens, max_tokens=cfg.max_tokens, threads=prep.threads,
            verify_after_write=cfg.verify_after_write, flood=cfg.watermarks.flood, min_free=cfg.watermarks.min_free,
            coordinator_pid=0 if prep.opts.ray else os.getpid(), final_state=cfg.final_state,
            batch_tokens=cfg.batch_tokens, backend=prep.backend.name,
            backend_settings=backend_settings if node is None else engine.settings_at(backend_settings, node),
            server_check=engine.server_check(node),
            final_norm=str(prep.lay.final_norm) if prep.lay.final_norm.exists() else None, history_ordinal=ordinal,
            regenerate=RegenSettings.of(cfg, meta))

    def _extract(self, plan: Plan, meta: dict, dump: DumpIndex | None, ordinal: int, gpu_build: bool) -> None:
        prep, session, workers, engine = self.prep, self._session, self._workers, self._engine
        flags = workers.flags
        pause = self._pause = SpacePause(session, self._space, flags, self.echo)
        if prep.opts.ray:
            workers.ray_pool()  # (every node probed before the first worker goes there)
        backend_settings = prep.backend.worker_settings(RunContext(  # (the same for every worker)
            prep.cfg, meta, imports=prep.opts.imports, model_name=engine.model_name(),
            staging_dir=engine.staging_dir()))
        by_id = {s.sample_id: s for s in plan.todo}
        dispatch = self._dispatch = Dispatcher(by_id, plan.attempts, dump.files if dump is not None else None)
        nodes = engine.nodes()  # --ray with a server backend: one worker per node's server, on that node
        for w, node in enumerate([None] * workers.count if nodes is None else nodes):
            dispatch.add(w, workers.start(self._settings(w, meta, backend_settings, node, ordinal), node))
        bar = prep.opts.progress or NoProgress()
        bar.start(len(plan.todo), "import" if prep.importing else "extract")
        reports = self._reports = Reports(
            session, workers, dispatch, self._space, engine, bar, self.echo, fingerprint=meta.get("model_fingerprint"),
            watermarks=prep.cfg.watermarks, data=prep.lay.data,
            imported=Imported(dump.files, prep.opts.imports.format) if dump is not None else None,
            run_id=self.run_id, run_ordinal=ordinal)
        gpus = GpuSampler(interval=5.0) if gpu_build else None
        # once stopping, workers still running a grace period after the stop request (or a worker's death) are
        # killed and named: a hung or SIGSTOPped worker cannot hold the run forever
        stop_since: float | None = None
        abort_since: float | None = None
        abort_grace = max(prep.stop_grace, ABORT_GRACE_SECONDS)
        try:
            while dispatch.alive():
                session.announce_stop()
                stopping = bool(session.stop_requested or reports.aborted or engine.stop_reason())
                flags.stop = stopping
                # fresh figures as soon as samples landed: a fast writer crosses `high` between two timed polls
                pause.poll(force=reports.landed())
                engine.watch()
                workers.drop_nodes(engine.gone())
                stalled = session.stalled
                if not stopping and pause.reason is None and not engine.down() and stalled is None:
                    dispatch.hand_out(pause.gate)
                dispatch.stop_idle(stopping, lost_ok=bool(prep.opts.ray))  # a sentinel once a worker is done
                for w in workers.readable(dispatch.alive(), timeout=0.1):
                    reports.drain(w)
                for w in dispatch.alive():
                    if workers.exited(w):
                        # read what it sent before exiting (`written`, `sealed`, `exit`) before judging it
                        reports.drain(w)
                        if dispatch.is_alive(w):
                            reports.worker_died(w)
                now = time.monotonic()
                if session.stop_requested and stop_since is None:
                    stop_since = now
                if reports.aborted and abort_since is None:
                    abort_since = now
                for since, grace in ((stop_since, prep.stop_grace), (abort_since, abort_grace)):
                    if since is not None and now - since > grace:
                        reports.give_up_on(grace)
                reports.commit_drops()  # (the drops' history record before their events)
                stats = gpus.poll() if gpus else None
                if stats:
                    session.emit(Event("gpu_stats", detail=detail(devices=stats)))
                session.flush()
                if pause.reason is None and not stopping:  # (a cache: never while space is short)
                    session.log.maybe_checkpoint_fold()  # status and sql stay fast on a long first run
                bar.update(note=f"STALLED: {stalled.what} on {stalled.path}" if stalled else
                           f"PAUSED: {pause.reason}" if pause.reason else "")
        finally:
            flags.stop, flags.gate_open = True, True
            bar.close()
            try:
                reports.commit_drops(force=True)
                session.flush(force=True)
                session.announce_stop()  # Ctrl-C as the loop's last turn drew the final reports: said here, once
            finally:
                # every worker still running told to stop, all joined within one shared deadline, the rest killed
                dispatch.stop_all(workers.running())
                workers.join_or_kill(SHUTDOWN_SECONDS)
                dispatch.close()


def cut_off_line(report: RunReport, cfg, root: Path) -> str:  # noqa: ANN001 - (BuildConfig)
    """What a regenerating run says at its end of the responses that stopped at the token limit."""
    limit = f"--max-new-tokens {cfg.max_new_tokens}" if cfg.max_new_tokens else "the token limit"
    if report.dropped:
        return (f"{report.dropped} regenerated response(s) stopped at the token limit ({limit}) and were retired "
                "(--drop-truncated)")
    return (f"{report.at_token_limit} regenerated response(s) stopped at the token limit ({limit}, finish_reason "
            f"length) and were kept; list them with: hsbuild sql {root} \"SELECT sample_id, generated FROM samples "
            "WHERE finish_reason = 'length'\"")


def tokenizer_for(cfg):  # noqa: ANN001, ANN201 - (BuildConfig; a tokenizer)
    """The build's tokenizer, for its source (loaded only when a row needs it)."""
    if is_builtin(cfg.model):
        return builtin_tokenizer(BuiltinSpec.parse(cfg.model).vocab)
    return HfTokenizer(Path(cfg.model))  # loaded at its first use: sources of input_ids never need it


def run_build(build: str | Path | Prepared, opts: RunOptions | None = None, resume: bool = False,
              echo: Echo = quiet) -> RunReport:
    """Run a build. `build`: its directory (the run prepared here, with `opts`), or a run already prepared
    (`prepare`: the CLI prepares it first, to start its standby workers with the count it decided). `echo`: where
    the run says things (the CLI passes its printer); by default nowhere."""
    if isinstance(build, Prepared):
        if opts is not None:
            raise TypeError("run_build: a prepared run carries its options; pass them to prepare()")
        return Coordinator(build, echo).run(resume=resume)
    return Coordinator(prepare(build, opts), echo).run(resume=resume)
