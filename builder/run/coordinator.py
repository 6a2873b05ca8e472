"""The coordinator: the one owner of the event log during a run.

It replays the log into a plan, starts the workers, hands them samples, commits their reports in batches,
answers live queries over its socket, pauses writers on disk watermarks, and stops at a safe point on Ctrl-C.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from pathlib import Path

from builder.config import load_config
from builder.doctor.gpu import GpuSampler
from builder.doctor.report import preflight_for_run, warning_lines
from builder.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SAMPLES_FAILED, ModelError, UsageError
from builder.extract.source import Sample, load_source
from builder.layout import layout
from builder.log.events import Event, EventBatch, detail, open_log
from builder.log.lock import BuildLock
from builder.log.server import QueryServer
from builder.progress import NoProgress, Progress
from builder.run.create import code_fingerprint
from builder.run.plan import Plan, check_source, make_plan
from builder.run.worker import Flags, Task, WorkerSettings, worker_main
from builder.space.capacity import measured_bytes_per_token, project
from builder.space.watermarks import SpaceMonitor


@dataclass
class RunOptions:
    workers: int | None = None
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
    take_over: bool = False  # take the lock over from an owner on another host (--take-over)


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


class Coordinator:
    def __init__(self, build: str | Path, opts: RunOptions | None = None, echo=print):
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
        self.workers = self.opts.workers or self.cfg.workers
        if self.workers < 1:
            raise UsageError(f"--workers {self.workers}: must be at least 1")
        self.echo = echo
        self.run_id = uuid.uuid4().hex
        self.stop_requested = 0
        self.aborted: str | None = None  # a worker died: stop at a safe point, `resume` continues
        self.space = SpaceMonitor(self.lay, self.cfg)
        self.paused_reason: str | None = None

    # -- signals ------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.stop_requested += 1
        if self.stop_requested >= 2:
            os._exit(EXIT_INTERRUPTED)  # still safe: nothing uncommitted is ever referenced
        self.echo("\nstopping at a safe point (Ctrl-C again to exit at once; still safe) ...")

    # -- events -------------------------------------------------------------------------------------------
    def emit(self, ev: Event) -> None:
        self.batch.emit(ev)

    def flush(self, force: bool = False) -> None:
        self.batch.flush(force)

    # -- live status ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        prog = self.log.progress()
        return {"running": True, "run_id": self.run_id, "pid": os.getpid(), "workers": self.workers,
                **prog, **project(self.log, self.cfg, self.space, self.meta), **self.space.snapshot(),
                "paused": self.paused_reason is not None, "pause_reason": self.paused_reason}

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> RunReport:
        lock = BuildLock(self.lay, "run", self.run_id, take_over=self.opts.take_over).acquire()
        try:
            # validate the source before the log is even opened: bad input changes nothing
            samples = load_source(self.cfg.source, _tokenizer_for(self.cfg))
            self.log = open_log(self.lay.events)
            self.batch = EventBatch(self.log, self.run_id, self.space.before_commit)
            try:
                return self._run_locked(lock, resume, samples)
            finally:
                self.log.close()
        finally:
            lock.release()

    def _run_locked(self, lock: BuildLock, resume: bool, samples: list[Sample]) -> RunReport:
        meta = self.meta = self.log.meta()
        added = check_source(self.log, samples)
        plan = make_plan(self.log, samples, self.cfg.max_attempts, self.opts.limit)
        report = RunReport(self.run_id, plan)
        if resume or plan.done or plan.interrupted or plan.failed_retry or plan.damaged:
            self.echo(
                f"replayed {self.log._seq} events: {plan.done} done, {len(plan.interrupted)} interrupted in flight, "
                f"{len(plan.failed_retry) + len(plan.failed_final)} failed ({len(plan.failed_retry)} to retry), "
                f"{len(plan.damaged)} damaged (re-extract), {len(plan.pending)} never started; "
                f"{len(plan.todo)} to do now" + (f" (+{added} new in source)" if added else "")
            )
        if plan.todo:
            doc = preflight_for_run(self.lay, self.cfg, self.log, self.opts.force, {os.getpid()},
                                    device=self.opts.device or self.cfg.device, run_id=self.run_id,
                                    previous_owner=lock.previous)
            self.gpu_build = doc.gpu_build
            for line in warning_lines(doc):
                self.echo(line)
        self.space.preflight(sum(s.num_tokens for s in plan.todo), meta, measured_bytes_per_token(self.log),
                             allow_overcommit=self.opts.allow_overcommit, echo=self.echo)
        by_id = {s.sample_id: s for s in plan.todo}
        self.emit(Event("run_started", detail=detail(
            workers=self.workers, resume=resume, plan=plan.summary(), config=self.cfg.to_toml(),
            config_fingerprint=self.cfg.fingerprint(), model_fingerprint=meta.get("model_fingerprint"),
            code_fingerprint=code_fingerprint(), pid=os.getpid(), previous_owner=lock.previous)))
        self.flush(force=True)
        server = QueryServer(lock.socket_path, self.log, self.status).start()
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            if plan.todo:
                self._extract(plan, by_id, meta, report)
        except BaseException as e:
            self.emit(Event("run_finished", reason="error", detail=detail(error=f"{type(e).__name__}: {e}")))
            self.flush(force=True)
            raise
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            server.stop()
        report.failed_in_build = self.log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0]
        if self.stop_requested:
            report.outcome, report.exit_code = "interrupted", EXIT_INTERRUPTED
        elif self.aborted:
            report.outcome, report.exit_code = "worker_died", EXIT_SAMPLES_FAILED
            report.messages.append(self.aborted)
        elif report.failed_in_build:
            report.exit_code = EXIT_SAMPLES_FAILED
        self.emit(Event("run_finished", reason=report.outcome, detail=detail(
            written=report.written, failed=report.failed, pauses=report.pauses,
            failed_in_build=report.failed_in_build)))
        self.flush(force=True)
        return report

    def _extract(self, plan: Plan, by_id: dict[str, Sample], meta: dict, report: RunReport) -> None:
        ctx = mp.get_context("spawn")
        flags = Flags(ctx)
        threads = max(1, (os.cpu_count() or 1) // self.workers)
        procs: dict[int, mp.process.BaseProcess] = {}
        conns: dict[int, Connection] = {}
        for w in range(self.workers):
            settings = WorkerSettings(
                build_root=str(self.lay.root), data_root=str(self.lay.data), run_id=self.run_id, worker=w,
                model=self.cfg.model, aux_layers=self.cfg.aux_layers, dtype=self.cfg.dtype,
                device=self.opts.device or self.cfg.device, codec=self.cfg.codec, chunk_tokens=self.cfg.chunk_tokens,
                max_tokens=self.cfg.max_tokens, threads=threads, verify_after_write=self.cfg.verify_after_write,
                flood=self.cfg.watermarks.flood, min_free=self.cfg.watermarks.min_free, coordinator_pid=os.getpid())
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, args=(settings, theirs, flags), daemon=True, name=f"hsbuild-worker-{w}")
            p.start()
            theirs.close()  # so a dead worker's pipe reads as EOF here
            procs[w], conns[w] = p, mine
        st = _Dispatch(pending=deque(s.sample_id for s in plan.todo), attempts=dict(plan.attempts),
                       assigned={w: [] for w in procs}, alive=set(procs))
        bar = self.opts.progress or NoProgress()
        bar.start(len(plan.todo), "extract")
        gpus = GpuSampler(interval=5.0) if getattr(self, "gpu_build", False) else None
        abort_deadline: float | None = None
        try:
            while st.alive:
                stopping = bool(self.stop_requested or self.aborted)
                flags.stop = stopping
                pause = self.space.poll()
                if pause != self.paused_reason:
                    self._set_paused(pause, flags, report)
                if not stopping and self.paused_reason is None:
                    self._dispatch(st, conns, by_id, flags, report)
                for w in sorted(st.alive - st.told_to_stop):  # a sentinel once a worker has nothing more to do
                    if stopping or (not st.pending and not st.assigned[w]):
                        _send(conns[w], None)
                        st.told_to_stop.add(w)
                for c in mp_connection.wait([conns[w] for w in st.alive], timeout=0.1):
                    w = next(k for k, v in conns.items() if v is c)
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        procs[w].join(timeout=5)
                        self._worker_died(w, procs[w].exitcode, st, report)
                        continue
                    self._handle(msg, st, by_id, meta, bar, report)
                for w, p in procs.items():
                    if w in st.alive and not p.is_alive():
                        self._worker_died(w, p.exitcode, st, report)
                if self.aborted and abort_deadline is None:
                    abort_deadline = time.monotonic() + 120
                if abort_deadline is not None and time.monotonic() > abort_deadline:
                    self.echo("workers did not stop within 120 s after the failure; killing them (still safe)")
                    break
                stats = gpus.poll() if gpus else None
                if stats:
                    self.emit(Event("gpu_stats", detail=detail(devices=stats)))
                self.flush()
                bar.update(note=f"PAUSED: {self.paused_reason}" if self.paused_reason else "")
        finally:
            flags.stop, flags.gate_open = True, True
            bar.close()
            self.flush(force=True)
            for w, p in procs.items():
                p.join(timeout=10 if w not in st.alive or not self.aborted else 0)
                if p.is_alive():
                    p.kill()
                conns[w].close()

    def _dispatch(self, st: _Dispatch, conns: dict, by_id: dict[str, Sample], flags: Flags, report: RunReport) -> None:
        """Hand out samples: at most PER_WORKER to each ready worker (one in hand, one waiting)."""
        for w in sorted(st.ready & st.alive - st.told_to_stop, key=lambda k: len(st.assigned[k])):
            while st.pending and len(st.assigned[w]) < PER_WORKER:
                pause = self.space.poll(force=True)  # fresh figures before every dispatch
                if pause is not None:
                    self._set_paused(pause, flags, report)
                    return
                sid = st.pending.popleft()
                s = by_id[sid]
                st.assigned[w].append(sid)
                _send(conns[w], Task(sid, st.attempts.get(sid, 0) + 1, s.fingerprint, s.input_ids, s.loss_mask))

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

    def _handle(self, msg, st: _Dispatch, by_id, meta, bar, report) -> None:
        kind, wid = msg[0], msg[1]
        if kind == "ready":
            fp = msg[2]
            st.ready.add(wid)
            if meta.get("model_fingerprint") and fp != meta["model_fingerprint"]:
                self.stop_requested = max(self.stop_requested, 1)
                raise ModelError(
                    f"model fingerprint {fp} differs from the build's {meta['model_fingerprint']}: the model changed "
                    "since `init`; restore it, or start a new build with `hsbuild init --force`"
                )
        elif kind == "fatal":
            raise ModelError(f"worker {wid} could not start: {msg[2]}")
        elif kind == "started":
            _, _, sid, attempt, fp, _t = msg
            st.current[wid] = sid
            st.attempts[sid] = attempt
            self.emit(Event("started", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid))
        elif kind == "written":
            _, _, sid, attempt, fp, loc, truncated, seconds, verified = msg
            self.emit(Event("written", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, segment=loc.segment,
                            token_start=loc.token_start, num_tokens=loc.num_tokens, nbytes=loc.nbytes,
                            checksums=json.dumps(loc.checksums, sort_keys=True),
                            detail=detail(truncated=truncated, seconds=round(seconds, 4))))
            if verified:
                self.emit(Event("verified", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                detail=detail(mode="after_write")))
            st.done(wid, sid)
            report.written += 1
            self.space.account(loc.nbytes, loc.num_tokens)
            bar.update(1, loc.num_tokens, loc.nbytes)
        elif kind == "failed":
            _, _, sid, attempt, fp, reason, message = msg
            self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, reason=reason,
                            detail=detail(message=message)))
            st.done(wid, sid)
            report.failed += 1
            bar.update(1)
        elif kind == "nospace":
            _, _, sid, attempt, fp, message = msg
            self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, reason="no_space",
                            detail=detail(message=message)))
            st.done(wid, sid, requeue=True)  # retried once space returns
            self.space.disk_full()
        elif kind == "deferred":
            st.done(wid, msg[2], requeue=True)
            self.space.flood_block(msg[3])
        elif kind in ("skipped", "abandoned"):
            st.done(wid, msg[2], requeue=not self.stop_requested)
        elif kind == "sealed":
            info = msg[2]
            self.emit(Event("segment_sealed", worker=wid, segment=info["segment"], num_tokens=info["tokens"],
                            detail=detail(**info)))
        elif kind == "seal_failed":
            self.emit(Event("segment_sealed", worker=wid, segment=msg[2], reason="seal_failed",
                            detail=detail(error=msg[3])))
        elif kind == "exit":
            st.alive.discard(wid)

    def _worker_died(self, w: int, code: int | None, st: _Dispatch, report: RunReport) -> None:
        """Its sample in hand failed (`worker_died`); samples only queued to it go back to pending; the run stops."""
        st.alive.discard(w)
        in_hand = st.current.pop(w, None)
        self.echo(f"\nworker {w} died (exit code {code})" + (f" while on sample {in_hand}" if in_hand else ""))
        for sid in st.assigned.pop(w, []):
            if sid == in_hand:
                self.emit(Event("failed", sample_id=sid, attempt=st.attempts.get(sid), worker=w,
                                reason="worker_died", detail=detail(exitcode=code)))
                report.failed += 1
            else:
                st.pending.appendleft(sid)
        st.assigned[w] = []
        self.aborted = f"worker {w} died (exit code {code})"
        self.echo("stopping the run at a safe point; `hsbuild resume` continues")


PER_WORKER = 2  # samples handed to a worker at once: one in hand, one waiting


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

    def done(self, w: int, sid: str, requeue: bool = False) -> None:
        if sid in self.assigned.get(w, []):
            self.assigned[w].remove(sid)
        if self.current.get(w) == sid:
            del self.current[w]
        if requeue:
            self.pending.appendleft(sid)


def _send(conn: Connection, obj: object) -> None:
    try:
        conn.send(obj)
    except (BrokenPipeError, OSError):
        pass  # the worker is gone; the main loop notices and accounts for its samples


def _tokenizer_for(cfg):
    if cfg.model == "builtin" or cfg.model.startswith("builtin:"):
        from builder.extract.model import BuiltinSpec, builtin_tokenizer  # noqa: PLC0415

        return builtin_tokenizer(BuiltinSpec.parse(cfg.model).vocab)
    try:
        import transformers  # noqa: PLC0415

        tok = transformers.AutoTokenizer.from_pretrained(cfg.model)
        return lambda text: tok(text)["input_ids"]
    except Exception:  # noqa: BLE001 - sources with input_ids need no tokenizer
        return None


def run_build(build: str | Path, opts: RunOptions | None = None, resume: bool = False, echo=print) -> RunReport:
    return Coordinator(build, opts, echo).run(resume=resume)
