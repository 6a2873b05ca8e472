"""Verification sweeps (`hsbuild verify`): select samples, read them back in parallel at a bounded rate, record
`verified` / `failed` events, and return typed findings. Nothing here prints; progress goes to the caller's `Progress`.

A sweep owns the build like a run does: it holds `BuildLock(lay, "verify")`, appends to the event log in
batches, and answers `hsbuild status` / `hsbuild sql` over the lock's socket. It records

    verify_started   detail: mode, selection (subset, fraction+seed, not_verified_since, segments), jobs,
                     max_rate, planned/skipped counts, and for a continuation `continues` + `chain`
    verified         one per sample whose bytes match its `written` checksums (full mode only)
    failed           one per damaged sample: reason checksum_mismatch | missing_data | unreadable
    verify_finished  reason completed | damage_found | check_errors (| continued, written by the sweep that
                     continues it)

and, before its last commit, its verdicts as a history record under data/history/ (builder/store/history.py),
so that a rebuilt log keeps them.

A sample whose check could not run (EMFILE, ENOMEM, EIO, ... after retries with backoff; see
`store.readback.check_with_retries`) gets no event at all: it keeps its state, is reported as `not_checked`, and a later
sweep checks it again.

An interrupted sweep (Ctrl-C, SIGKILL, an error) has no `verify_finished`; `--continue` takes the newest such
sweep, reuses its selection, and skips every sample a sweep of its chain already recorded.

Its options and the selection they make: verify/selection.py; what it finds and its summary: verify/findings.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path

from builder.config import load_config
from builder.errors import UsageError
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.kinds import EventKind
from builder.log.lock import BuildLock
from builder.log.session import OwnerSession
from builder.procfs import usable_cpus
from builder.progress import Echo, NoProgress, quiet
from builder.store.direct import FieldLayout
from builder.store.history import Verdicts
from builder.store.readback import (
    MISMATCH,
    MISSING,
    UNREADABLE,
    SampleCheck,
    SharedReader,
    check_files,
    check_sample,
    check_with_retries,
    field_specs,
)
from builder.verify.batch import check_unit
from builder.verify.findings import MB, Damage, NotChecked, SweepSummary, find_overlaps
from builder.verify.gc import scan_orphans
from builder.verify.selection import (
    Selection,
    SweepOptions,
    default_jobs,
    parse_jobs,
    parse_rate,
)
from builder.verify.targets import Target, Targets, select

SWEEP_DETAIL = detail(mode="sweep")
FLUSH_EVENTS = 8192  # verdicts committed at least every 0.5 s (FLUSH_SECONDS), or once this many are pending  # a sweep's `verified` events'
INFLIGHT_UNITS = 8  # units queued per reader: they keep reading while the main thread waits for a commit
STOP_WHAT = "stopping the sweep (Ctrl-C again to exit at once; continue later with --continue)"


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


class RateLimiter:
    """Paces readers to `rate` bytes/s: each charges what it read and sleeps until its share of time is due."""

    def __init__(self, rate: float, stop: threading.Event):
        self.rate, self.stop = rate, stop
        self.lock = threading.Lock()
        self.due = time.monotonic()

    def charge(self, nbytes: int) -> None:
        with self.lock:
            self.due = max(self.due, time.monotonic() - 0.05) + nbytes / self.rate
            due = self.due
        delay = due - time.monotonic()
        if delay > 0:
            self.stop.wait(delay)


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


class Sweep:
    def __init__(self, build: str | Path, opts: SweepOptions | None = None, echo: Echo = quiet):
        self.lay: BuildLayout = layout(build).require()
        self.opts = opts or SweepOptions()
        self.echo = echo
        if self.opts.resume and any(v is not None for v in (self.opts.subset, self.opts.fraction, self.opts.seed,
                                                            self.opts.not_verified_since, self.opts.segments)):
            raise UsageError("--continue: continues the interrupted sweep with its own selection; "
                             "do not combine it with --subset/--fraction/--seed/--not-verified-since/--segment")
        if self.opts.resume and self.opts.quick:
            raise UsageError("--continue: takes the interrupted sweep's mode; do not combine it with --quick")
        self.selection = Selection.from_options(self.opts)  # validates the flags before anything is locked
        self.jobs_given = parse_jobs(self.opts.jobs)
        self.jobs = self.jobs_given or 1  # (without --jobs: `default_jobs`, once the samples are selected)
        self.rate = parse_rate(self.opts.max_rate) * MB if self.opts.max_rate is not None else None
        self.sweep_id = uuid.uuid4().hex
        self.stop = threading.Event()  # the session's stop event once the sweep owns the build
        self.session: OwnerSession | None = None
        self.summary: SweepSummary | None = None
        self._geometry: dict[str, tuple[int, dict | None]] = {}  # segment -> (chunk_tokens, field specs)
        self._layouts: dict[str, dict[str, FieldLayout] | None] = {}  # segment -> read a unit at a time (`_direct`)
        self.verdicts = Verdicts()  # what this sweep recorded, for its history record

    # -- plumbing -------------------------------------------------------------------------------------
    def _announce_stop(self) -> None:
        """Said once, from the main thread (the signal handler only records the request: builder/log/session.py);
        a second Ctrl-C exits at once, still safe: every committed event describes bytes that were checked."""
        self.session.announce_stop(STOP_WHAT)

    def emit(self, ev: Event) -> None:
        self.batch.emit(ev)

    def flush(self, force: bool = False) -> None:
        self.session.flush(force)

    def status(self) -> dict:
        s = self.summary
        sweep = {"mode": s.mode, **s.counts()} if s else {}
        return {"running": True, "purpose": "verify", "run_id": self.sweep_id, "pid": os.getpid(),
                "workers": self.jobs, **self.log.progress(), "sweep": sweep}

    # -- entry ----------------------------------------------------------------------------------------
    def run(self) -> SweepSummary:
        with OwnerSession(self.lay, "verify", self.sweep_id, take_over=self.opts.take_over, echo=self.echo,
                          status=self.status) as session:
            self.session = session
            self.stop = session.stop_event  # set by Ctrl-C/SIGTERM: the readers and the loop stop
            self.log = session.open(signals=False)
            self.batch = session.batch
            self.batch.max_events = FLUSH_EVENTS  # a commit costs its fsyncs, not its rows: fewer, bigger ones
            return self._run_locked(session.lock)

    def _run_locked(self, lock: BuildLock) -> SweepSummary:
        continues, chain = None, []
        if self.opts.resume:
            prev = last_unfinished_sweep(self.log)
            if prev is None:
                raise UsageError("--continue: no interrupted verify sweep to continue (every sweep has finished)")
            continues, chain = prev["run_id"], [*prev.get("chain", []), prev["run_id"]]
            self.selection = Selection.from_detail(prev.get("selection", {}))
            self.echo(f"continuing sweep {continues[:8]} of {prev['ts']} ({self.selection.describe()})")
        targets, skipped = self._select(chain)
        if self.jobs_given is None:
            self.jobs = default_jobs(self.selection.mode == "quick", targets.mean_nbytes(), usable_cpus())
        s = self.summary = SweepSummary(self.sweep_id, self.selection.mode, self.selection,
                                        dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0), continues,
                                        selected=len(targets) + skipped, skipped=skipped)
        if continues:
            self.emit(Event(EventKind.VERIFY_FINISHED, run_id=continues, reason="continued",
                            detail=detail(continued_by=self.sweep_id)))
        self.emit(Event(EventKind.VERIFY_STARTED, detail=detail(
            mode=self.selection.mode, selection=asdict(self.selection), jobs=self.jobs,
            max_rate_mb_s=self.rate / MB if self.rate else None, planned=len(targets), skipped=skipped,
            continues=continues, chain=chain, pid=os.getpid(), previous_owner=lock.previous)))
        self.flush(force=True)
        self.session.stop_what = STOP_WHAT  # (also said while a commit waits for a stalled volume)
        self.session.take_signals()  # (kept until the lock is released: a late Ctrl-C is still a request)
        try:
            s.orphans = scan_orphans(self.lay, self.log)
            s.overlaps = find_overlaps(self.log, self._chunk_tokens)
            self._check_all(targets)
        finally:
            self._announce_stop()
            try:  # the verdicts beside the data (write-once), so a rebuilt log keeps them (builder/store/history.py)
                self.verdicts.write(self.lay.data, self.sweep_id, self.selection.mode)
            finally:
                self.flush(force=True)  # whatever was checked stays recorded, even on an error
        s.damaged.sort(key=lambda d: (d.segment, d.token_start, d.sample_id))
        s.not_checked.sort(key=lambda n: (n.segment, n.token_start, n.sample_id))
        if self.stop.is_set():
            s.outcome = "interrupted"  # no verify_finished: --continue picks this sweep up
            return s
        s.outcome = "damage_found" if s.damage_found else "check_errors" if s.not_checked else "completed"
        self.emit(Event(EventKind.VERIFY_FINISHED, reason=s.outcome, detail=detail(
            **s.counts(), reclaimable=s.orphans.as_dict(), damaged=[d.sample_id for d in s.damaged][:1000],
            not_checked=[n.sample_id for n in s.not_checked][:1000])))
        self.flush(force=True)
        return s

    # -- selection --------------------------------------------------------------------------------------
    def _select(self, chain: list[str]) -> tuple[Targets, int]:
        targets, skipped, known = select(self.log, self.selection, self.selection.mode == "quick",
                                         self._already_checked(chain))
        unknown = [g for g in self.selection.segments or [] if g not in known]
        if unknown:
            raise UsageError(f"--segment {unknown[0]}: no live sample of this build is stored in that segment")
        return targets, skipped

    def _already_checked(self, chain: list[str]) -> dict[str, int]:
        if not chain:
            return {}
        marks = ",".join("?" * len(chain))
        _, rows = self.log.query(f"SELECT sample_id, max(seq) FROM events WHERE run_id IN ({marks}) "
                                 "AND kind IN ('verified', 'failed') AND sample_id IS NOT NULL GROUP BY sample_id",
                                 chain)
        return {sid: seq for sid, seq in rows}

    # -- checking -----------------------------------------------------------------------------------------
    def _segment_geometry(self, segment: str) -> tuple[int, dict | None]:
        """Chunk length and field specs of a segment, from its metadata (the build config if that is gone)."""
        if segment not in self._geometry:
            specs = field_specs(self.lay.data / segment)
            ct = specs["input_ids"].chunk_tokens if specs else load_config(self.lay).chunk_tokens
            self._geometry[segment] = (ct, specs)
        return self._geometry[segment]

    def _chunk_tokens(self, segment: str) -> int:
        return self._segment_geometry(segment)[0]

    def _direct(self, segment: str, reader: SharedReader) -> dict[str, FieldLayout] | None:
        """The segment's field layouts when its samples can be checked a unit at a time (verify/batch.py): every
        field sharded and read directly by hsbuild's reader, and (full sweeps) Zarr opens its arrays. None: its
        samples are checked one by one (and any trouble found there)."""
        if segment not in self._layouts:
            lays = None
            try:
                metas = reader.metas(segment)
                found = {f: FieldLayout.from_meta(m) for f, m in metas.items()}
                if all(v is not None for v in found.values()):
                    if self.selection.mode == "full":
                        reader.arrays(segment)
                    lays = found
            except Exception:  # noqa: BLE001 - whatever it is, the per-sample check meets it and says what
                lays = None
            self._layouts[segment] = lays  # type: ignore[assignment]
        return self._layouts[segment]

    def _check_one(self, t: Target, reader: SharedReader, first_error: BaseException | None = None) -> SampleCheck:
        """Check one sample; an error that says nothing about its data (EMFILE, ENOMEM, EIO, ...) is retried with
        backoff and, if it persists, comes back as `SampleCheck.error`, never as damage (`first_error`: a transient
        error its unit's check already hit, its first try)."""
        ct, specs = self._segment_geometry(t.segment)
        if self.selection.mode == "quick":
            return check_with_retries(lambda: check_files(self.lay.data, t.segment, t.token_start, t.num_tokens, ct,
                                                          t.nbytes, quick=True, specs=specs), sleep=self.stop.wait,
                                      first_error=first_error)
        return check_with_retries(lambda: check_sample(self.lay.data, t.segment, t.token_start, t.num_tokens,
                                                       t.checksums, ct, reader), sleep=self.stop.wait,
                                  first_error=first_error)

    def _check_unit(self, batch: list[Target], reader: SharedReader,
                    limiter: RateLimiter | None) -> list[SampleCheck]:
        """Check a unit of samples (verify/batch.py) at once; those it cannot pass are checked one by one."""
        lays = self._layouts.get(batch[0].segment)
        if lays is None:
            res = [self._check_one(t, reader) for t in batch]
        else:
            outs = check_unit(self.lay.data, batch[0].segment, lays, batch, self.selection.mode == "quick")
            res = [o if isinstance(o, SampleCheck) else self._check_one(t, reader, o.first_error)
                   for o, t in zip(outs, batch, strict=True)]
        if limiter is not None:
            limiter.charge(sum(r.file_bytes for r in res))
        return res

    def _check_all(self, targets: Targets) -> None:
        s = self.summary
        assert s is not None
        reader = SharedReader(self.lay.data)
        bar = self.opts.progress or NoProgress()
        bar.start(len(targets), "verify" if s.mode == "full" else "verify --quick")
        limiter = RateLimiter(self.rate, self.stop) if self.rate and s.mode == "full" else None
        t0 = time.monotonic()
        todo: Iterator[tuple[int, int]] = targets.units(lambda seg: self._direct(seg, reader), join=limiter is None)
        inflight: dict[Future, list[Target]] = {}
        pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="hsbuild-verify")
        try:
            while True:
                if self.stop.is_set():  # units not begun are left to --continue: the stop comes at once
                    for fut in [f for f in inflight if f.cancel()]:
                        del inflight[fut]
                while not self.stop.is_set() and len(inflight) < INFLIGHT_UNITS * self.jobs:
                    span = next(todo, None)
                    if span is None:
                        break
                    batch = targets.take(*span)
                    inflight[pool.submit(self._check_unit, batch, reader, limiter)] = batch
                if not inflight:
                    break
                self._announce_stop()
                done, _ = wait(list(inflight), timeout=0.2, return_when=FIRST_COMPLETED)
                for fut in done:
                    batch = inflight.pop(fut)
                    results = fut.result()
                    if all(r.finding is None and r.error is None for r in results):
                        nbytes = self._record_passed(batch, results)
                    else:
                        nbytes = 0
                        for t, res in zip(batch, results, strict=True):
                            self._record(t, res)
                            nbytes += res.file_bytes
                    bar.update(len(batch), sum(t.num_tokens for t in batch), nbytes)
                self.flush()
                bar.update()
        except BaseException:
            self.stop.set()  # wake paced readers so the pool shuts down at once
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # (units not begun are not begun)
            s.seconds = time.monotonic() - t0
            bar.close()

    def _written_by(self, t: Target) -> tuple[str | None, int | None]:
        """The fingerprint and attempt of the `written` event a damaged sample is live by (its `failed` event
        names them, as resume reads it)."""
        _, rows = self.log.query("SELECT fingerprint, attempt FROM events WHERE seq = ?", [t.written_seq])
        return rows[0] if rows else (None, None)

    def _record_passed(self, batch: list[Target], results: list[SampleCheck]) -> int:
        """`_record` for a unit whose samples all passed (a unit is of one segment), at once. Returns the bytes
        read."""
        s = self.summary
        assert s is not None
        file_bytes = [r.file_bytes for r in results]
        nbytes = sum(file_bytes)
        s.checked += len(batch)
        s.ok += len(batch)
        s.bytes_read += nbytes if s.mode == "full" else 0
        s.raw_bytes += sum(r.raw_bytes for r in results)
        if s.mode == "full":
            emit = self.emit
            for t, n in zip(batch, file_bytes, strict=True):
                emit(Event(EventKind.VERIFIED, sample_id=t.sample_id, segment=t.segment, token_start=t.token_start,
                           num_tokens=t.num_tokens, nbytes=n, detail=SWEEP_DETAIL))
            for seg in dict.fromkeys(t.segment for t in batch):
                self.verdicts.extend(seg, [t.token_start for t in batch if t.segment == seg], "verified")
        return nbytes

    def _record(self, t: Target, res: SampleCheck) -> None:
        s = self.summary
        assert s is not None
        if res.error is not None:  # the check could not run: no event, the sample keeps its state
            s.check_errors += 1
            s.not_checked.append(NotChecked(t.sample_id, res.error, t.segment, t.token_start, t.num_tokens))
            return
        s.checked += 1
        s.bytes_read += res.file_bytes if s.mode == "full" else 0
        s.raw_bytes += res.raw_bytes
        loc = {"sample_id": t.sample_id, "segment": t.segment, "token_start": t.token_start,
               "num_tokens": t.num_tokens}
        if res.finding is None:
            s.ok += 1
            if s.mode == "full":  # (the sample's fingerprint and attempt are its `written` event's: not repeated)
                self.emit(Event(EventKind.VERIFIED, nbytes=res.file_bytes, detail=SWEEP_DETAIL, **loc))
                self.verdicts.add(t.segment, t.token_start, "verified")
            return
        loc["fingerprint"], loc["attempt"] = self._written_by(t)
        reason, message = res.finding
        if reason == MISMATCH:
            s.mismatched += 1
        elif reason == MISSING:
            s.missing += 1
        elif reason == UNREADABLE:
            s.unreadable += 1
        s.damaged.append(Damage(t.sample_id, reason, message, t.segment, t.token_start, t.num_tokens))
        self.emit(Event(EventKind.FAILED, reason=reason, detail=detail(message=message, mode=s.mode), **loc))
        self.verdicts.add(t.segment, t.token_start, reason)


def last_unfinished_sweep(log: EventLog) -> dict | None:
    """The newest `verify_started` without a `verify_finished`, with its detail."""
    _, rows = log.query(
        "SELECT s.run_id, s.ts, s.detail FROM events s WHERE s.kind = 'verify_started' AND NOT EXISTS ("
        "  SELECT 1 FROM events f WHERE f.kind = 'verify_finished' AND f.run_id = s.run_id) "
        "ORDER BY s.seq DESC LIMIT 1")
    if not rows:
        return None
    run_id, ts, det = rows[0]
    return {"run_id": run_id, "ts": ts, **json.loads(det or "{}")}


def run_sweep(build: str | Path, opts: SweepOptions | None = None, echo: Echo = quiet) -> SweepSummary:
    """`hsbuild verify`: one sweep over the build. Raises UsageError for bad options, BuildLockedError if busy.
    What it says as it goes (a continued sweep, a stall, a stop) goes to `echo`; silent without one."""
    return Sweep(build, opts, echo).run()
