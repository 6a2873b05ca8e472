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
`checks.check_with_retries`) gets no event at all: it keeps its state, is reported as `not_checked`, and a later
sweep checks it again.

An interrupted sweep (Ctrl-C, SIGKILL, an error) has no `verify_finished`; `--continue` takes the newest such
sweep, reuses its selection, and skips every sample a sweep of its chain already recorded.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from builder.config import load_config
from builder.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SAMPLES_FAILED, UsageError
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.lock import BuildLock
from builder.log.session import OwnerSession
from builder.progress import NoProgress, Progress
from builder.store.history import Verdicts
from builder.store.reader import SegmentReader
from builder.verify.checks import (
    MISMATCH,
    MISSING,
    UNREADABLE,
    SampleCheck,
    check_files,
    check_sample,
    check_with_retries,
    field_specs,
)
from builder.verify.gc import OrphanReport, scan_orphans

MB = 1_000_000
STOP_WHAT = "stopping the sweep (Ctrl-C again to exit at once; continue later with --continue)"


# ---------------------------------------------------------------------------------------------------------
# Options and selection
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SweepOptions:
    quick: bool = False
    subset: str | None = None  # "n/t": the n-th of t fixed parts (1-based)
    fraction: float | str | None = None  # a random fraction of the samples, 0 < F <= 1
    seed: int | str | None = None  # for --fraction; recorded so --continue picks the same samples
    not_verified_since: str | dt.datetime | None = None  # ISO timestamp; naive means UTC
    segments: list[str] | None = None
    max_rate: float | str | None = None  # MB/s (10^6 bytes) of chunk-file bytes read
    jobs: int | str | None = None
    resume: bool = False  # --continue
    progress: Progress | None = None  # where progress is reported (the CLI draws a bar); None: nowhere
    take_over: bool = False  # take the lock over from an owner on another host (--take-over)


def parse_subset(s: str) -> tuple[int, int]:
    n_s, sep, t_s = str(s).partition("/")
    try:
        n, t = int(n_s), int(t_s)
    except ValueError:
        n = t = 0
    if not sep or not 1 <= n <= t:
        raise UsageError(f"--subset '{s}': give n/t with 1 <= n <= t, e.g. 1/3 (t sweeps 1/t .. t/t cover all)")
    return n, t


def parse_fraction(s: float | str) -> float:
    try:
        f = float(s)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise UsageError(f"--fraction '{s}': give a number in (0, 1], e.g. 0.05")
    return f


def parse_time(s: str | dt.datetime) -> dt.datetime:
    """An ISO timestamp as naive UTC (the log's convention). Naive input is taken as UTC."""
    if isinstance(s, dt.datetime):
        t = s
    else:
        try:
            t = dt.datetime.fromisoformat(str(s).strip())
        except ValueError:
            raise UsageError(f"--not-verified-since '{s}': give an ISO timestamp in UTC, "
                             "e.g. 2025-05-01T12:00:00Z") from None
    if t.tzinfo is not None:
        t = t.astimezone(dt.UTC).replace(tzinfo=None)
    return t


def parse_rate(s: float | str) -> float:
    try:
        r = float(s)
    except ValueError:
        r = -1.0
    if not r > 0:
        raise UsageError(f"--max-rate '{s}': give MB/s as a positive number, e.g. 200")
    return r


def parse_jobs(s: int | str | None) -> int:
    if s is None:
        return max(1, min(4, os.cpu_count() or 1))
    try:
        j = int(s)
    except ValueError:
        j = 0
    if not 1 <= j <= 256:
        raise UsageError(f"--jobs '{s}': give a number of parallel readers from 1 to 256")
    return j


def parse_seed(s: int | str) -> int:
    try:
        return int(s)
    except ValueError:
        raise UsageError(f"--seed '{s}': give an integer") from None


def stable_part(sample_id: str, parts: int) -> int:
    """0-based part of a sample among `parts`, the same on every machine and every run."""
    h = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % parts


def _draw(sample_id: str, seed: int) -> float:
    h = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


@dataclass
class Selection:
    """Which samples a sweep covers. Stored in `verify_started` so `--continue` selects the same ones."""

    mode: str = "full"  # full | quick
    subset: str | None = None
    fraction: float | None = None
    seed: int | None = None
    not_verified_since: str | None = None  # ISO, naive UTC
    segments: list[str] | None = None

    @classmethod
    def from_options(cls, o: SweepOptions) -> Selection:
        sel = cls(mode="quick" if o.quick else "full")
        if o.subset is not None:
            n, t = parse_subset(o.subset)
            sel.subset = f"{n}/{t}"
        if o.fraction is not None:
            sel.fraction = parse_fraction(o.fraction)
            sel.seed = parse_seed(o.seed) if o.seed is not None else random.SystemRandom().randrange(1 << 31)
        elif o.seed is not None:
            raise UsageError("--seed: only meaningful with --fraction")
        if o.not_verified_since is not None:
            sel.not_verified_since = parse_time(o.not_verified_since).isoformat()
        if o.segments:
            sel.segments = sorted(set(o.segments))
        return sel

    @classmethod
    def from_detail(cls, d: dict) -> Selection:
        return cls(**{k: d.get(k) for k in ("mode", "subset", "fraction", "seed", "not_verified_since", "segments")})

    def matches(self, sample_id: str, segment: str, verified_at: dt.datetime | None) -> bool:
        if self.segments and segment not in self.segments:
            return False
        if self.subset:
            n, t = parse_subset(self.subset)
            if stable_part(sample_id, t) != n - 1:
                return False
        if self.fraction is not None and _draw(sample_id, int(self.seed or 0)) >= self.fraction:
            return False
        if self.not_verified_since is not None and verified_at is not None:
            if verified_at >= dt.datetime.fromisoformat(self.not_verified_since):
                return False
        return True

    def describe(self) -> str:
        parts = [self.mode]
        if self.subset:
            parts.append(f"subset {self.subset}")
        if self.fraction is not None:
            parts.append(f"fraction {self.fraction:g} (seed {self.seed})")
        if self.not_verified_since:
            parts.append(f"not verified since {self.not_verified_since}Z")
        if self.segments:
            parts.append("segment " + ", ".join(self.segments))
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Findings and the summary
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Damage:
    """A sample whose stored bytes are not what its `written` event recorded."""

    sample_id: str
    reason: str  # checksum_mismatch | missing_data | unreadable
    message: str
    segment: str
    token_start: int
    num_tokens: int


@dataclass
class NotChecked:
    """A sample whose check could not run (resources or I/O, not its data): nothing was recorded for it."""

    sample_id: str
    message: str
    segment: str
    token_start: int
    num_tokens: int
    reason: str = "check_error"


@dataclass
class Overlap:
    """Two live samples whose chunk ranges in one segment overlap: at most one of them holds its own bytes."""

    segment: str
    first: str
    second: str
    first_chunks: tuple[int, int]
    second_chunks: tuple[int, int]


@dataclass
class SweepSummary:
    sweep_id: str
    mode: str
    selection: Selection
    started_at: dt.datetime  # UTC, naive
    continues: str | None = None
    selected: int = 0  # samples the selection covers now
    skipped: int = 0  # already checked by the sweep being continued
    checked: int = 0  # samples whose check ran (ok + damaged)
    check_errors: int = 0  # samples whose check could not run (not_checked)
    ok: int = 0
    mismatched: int = 0
    missing: int = 0
    unreadable: int = 0
    bytes_read: int = 0  # compressed chunk-file bytes read (what --max-rate limits)
    raw_bytes: int = 0  # uncompressed bytes checksummed
    seconds: float = 0.0  # the reading phase
    outcome: str = "completed"  # completed | damage_found | check_errors | interrupted
    damaged: list[Damage] = field(default_factory=list)
    not_checked: list[NotChecked] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)
    orphans: OrphanReport = field(default_factory=OrphanReport)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / MB if self.seconds > 0 else 0.0

    @property
    def raw_mb_per_s(self) -> float:
        return self.raw_bytes / self.seconds / MB if self.seconds > 0 else 0.0

    @property
    def damage_found(self) -> bool:
        return bool(self.damaged or self.overlaps)

    @property
    def exit_code(self) -> int:
        """130 interrupted; 1 damage found, or some samples could not be checked (good is not established;
        nothing was condemned: retry); 0 every selected sample was checked and is good."""
        if self.outcome == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_SAMPLES_FAILED if self.damage_found or self.not_checked else EXIT_OK

    def counts(self) -> dict:
        return {"selected": self.selected, "skipped": self.skipped, "checked": self.checked,
                "check_errors": self.check_errors, "ok": self.ok,
                "mismatched": self.mismatched, "missing": self.missing, "unreadable": self.unreadable,
                "overlaps": len(self.overlaps), "bytes_read": self.bytes_read, "raw_bytes": self.raw_bytes,
                "seconds": round(self.seconds, 3), "mb_per_s": round(self.mb_per_s, 3),
                "raw_mb_per_s": round(self.raw_mb_per_s, 3)}

    def as_dict(self) -> dict:
        return {"sweep_id": self.sweep_id, "mode": self.mode, "outcome": self.outcome,
                "started_at": self.started_at.isoformat() + "Z", "continues": self.continues,
                "selection": asdict(self.selection), **self.counts(),
                "damaged": [asdict(d) for d in self.damaged], "not_checked": [asdict(n) for n in self.not_checked],
                "overlaps": [asdict(o) for o in self.overlaps],
                "reclaimable": self.orphans.as_dict()}


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    """One sample to check: its live location and what its `written` event recorded."""

    sample_id: str
    segment: str
    token_start: int
    num_tokens: int
    nbytes: int | None
    checksums: str
    fingerprint: str | None
    attempt: int | None
    written_seq: int
    verified_at: dt.datetime | None


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


class SharedReader(SegmentReader):
    """A SegmentReader whose cache of opened segments is safe to share between reader threads."""

    def __init__(self, data_root: Path):
        super().__init__(data_root)
        self._lock = threading.Lock()

    def arrays(self, segment: str) -> dict:
        with self._lock:
            return super().arrays(segment)


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


class Sweep:
    def __init__(self, build: str | Path, opts: SweepOptions | None = None, echo: Callable[[str], None] = print):
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
        self.jobs = parse_jobs(self.opts.jobs)
        self.rate = parse_rate(self.opts.max_rate) * MB if self.opts.max_rate is not None else None
        self.sweep_id = uuid.uuid4().hex
        self.stop = threading.Event()  # the session's stop event once the sweep owns the build
        self.session: OwnerSession | None = None
        self.summary: SweepSummary | None = None
        self._geometry: dict[str, tuple[int, dict | None]] = {}  # segment -> (chunk_tokens, field specs)
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
        s = self.summary = SweepSummary(self.sweep_id, self.selection.mode, self.selection,
                                        dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0), continues,
                                        selected=len(targets) + skipped, skipped=skipped)
        if continues:
            self.emit(Event("verify_finished", run_id=continues, reason="continued",
                            detail=detail(continued_by=self.sweep_id)))
        self.emit(Event("verify_started", detail=detail(
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
        self.emit(Event("verify_finished", reason=s.outcome, detail=detail(
            **s.counts(), reclaimable=s.orphans.as_dict(), damaged=[d.sample_id for d in s.damaged][:1000],
            not_checked=[n.sample_id for n in s.not_checked][:1000])))
        self.flush(force=True)
        return s

    # -- selection --------------------------------------------------------------------------------------
    def _select(self, chain: list[str]) -> tuple[list[Target], int]:
        _, rows = self.log.query(
            "SELECT s.sample_id, s.segment, s.token_start, s.num_tokens, s.nbytes, s.checksums, w.fingerprint, "
            "w.attempt, w.seq, s.verified_at FROM samples s JOIN ("
            "  SELECT sample_id, seq, fingerprint, attempt FROM events WHERE kind = 'written'"
            "  QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1) w USING (sample_id) "
            "WHERE s.state IN ('written', 'verified') ORDER BY s.segment, s.token_start")
        if self.selection.segments:
            known = {r[1] for r in rows}
            unknown = [g for g in self.selection.segments if g not in known]
            if unknown:
                raise UsageError(f"--segment {unknown[0]}: no live sample of this build is stored in that segment")
        done = self._already_checked(chain)
        targets, skipped = [], 0
        for r in rows:
            t = Target(*r)
            if not self.selection.matches(t.sample_id, t.segment, t.verified_at):
                continue
            if done.get(t.sample_id, -1) > t.written_seq:
                skipped += 1
                continue
            targets.append(t)
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

    def _check_one(self, t: Target, reader: SharedReader, limiter: RateLimiter | None) -> SampleCheck:
        """Check one sample; an error that says nothing about its data (EMFILE, ENOMEM, EIO, ...) is retried with
        backoff and, if it persists, comes back as `SampleCheck.error`, never as damage."""
        ct, specs = self._segment_geometry(t.segment)
        if self.selection.mode == "quick":
            return check_with_retries(lambda: check_files(self.lay.data, t.segment, t.token_start, t.num_tokens, ct,
                                                          t.nbytes, quick=True, specs=specs), sleep=self.stop.wait)
        res = check_with_retries(lambda: check_sample(self.lay.data, t.segment, t.token_start, t.num_tokens,
                                                      t.checksums, ct, reader), sleep=self.stop.wait)
        if limiter is not None:
            limiter.charge(res.file_bytes)
        return res

    def _check_all(self, targets: list[Target]) -> None:
        s = self.summary
        assert s is not None
        reader = SharedReader(self.lay.data)
        bar = self.opts.progress or NoProgress()
        bar.start(len(targets), "verify" if s.mode == "full" else "verify --quick")
        limiter = RateLimiter(self.rate, self.stop) if self.rate and s.mode == "full" else None
        t0 = time.monotonic()
        todo: Iterator[Target] = iter(targets)
        inflight: dict[Future, Target] = {}
        try:
            with ThreadPoolExecutor(self.jobs, thread_name_prefix="hsbuild-verify") as pool:
                while True:
                    while not self.stop.is_set() and len(inflight) < 2 * self.jobs:
                        t = next(todo, None)
                        if t is None:
                            break
                        inflight[pool.submit(self._check_one, t, reader, limiter)] = t
                    if not inflight:
                        break
                    self._announce_stop()
                    done, _ = wait(list(inflight), timeout=0.2, return_when=FIRST_COMPLETED)
                    for fut in done:
                        t = inflight.pop(fut)
                        res = fut.result()
                        self._record(t, res)
                        bar.update(1, t.num_tokens, res.file_bytes)
                    self.flush()
                    bar.update()
        except BaseException:
            self.stop.set()  # wake paced readers so the pool shuts down at once
            raise
        finally:
            s.seconds = time.monotonic() - t0
            bar.close()

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
        loc = {"sample_id": t.sample_id, "fingerprint": t.fingerprint, "attempt": t.attempt, "segment": t.segment,
               "token_start": t.token_start, "num_tokens": t.num_tokens}
        if res.finding is None:
            s.ok += 1
            if s.mode == "full":
                self.emit(Event("verified", nbytes=res.file_bytes, detail=detail(mode="sweep"), **loc))
                self.verdicts.add(t.segment, t.token_start, "verified")
            return
        reason, message = res.finding
        if reason == MISMATCH:
            s.mismatched += 1
        elif reason == MISSING:
            s.missing += 1
        elif reason == UNREADABLE:
            s.unreadable += 1
        s.damaged.append(Damage(t.sample_id, reason, message, t.segment, t.token_start, t.num_tokens))
        self.emit(Event("failed", reason=reason, detail=detail(message=message, mode=s.mode), **loc))
        self.verdicts.add(t.segment, t.token_start, reason)


def find_overlaps(log: EventLog, chunk_tokens: Callable[[str], int]) -> list[Overlap]:
    """Live samples sharing a chunk: the log says two samples own the same bytes."""
    _, rows = log.query("SELECT segment, token_start, num_tokens, sample_id FROM samples "
                        "WHERE state IN ('written', 'verified') ORDER BY segment, token_start, sample_id")
    out: list[Overlap] = []
    prev: tuple[str, str, int, int] | None = None  # segment, sample, first chunk, last chunk
    for seg, start, n, sid in rows:
        ct = chunk_tokens(seg)
        first, last = start // ct, (start + max(n, 1) - 1) // ct
        if prev is not None and prev[0] == seg and first <= prev[3]:
            out.append(Overlap(seg, prev[1], sid, (prev[2], prev[3]), (first, last)))
        if prev is None or prev[0] != seg or last > prev[3]:
            prev = (seg, sid, first, last)
    return out


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


def run_sweep(build: str | Path, opts: SweepOptions | None = None,
              echo: Callable[[str], None] = print) -> SweepSummary:
    """`hsbuild verify`: one sweep over the build. Raises UsageError for bad options, BuildLockedError if busy."""
    return Sweep(build, opts, echo).run()
