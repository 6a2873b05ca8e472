"""Extraction worker process: loads the model, extracts, writes samples into its own segment.

Workers never touch the event log. They report to the coordinator over their own pipe, in the typed messages
of builder.run.messages; the coordinator commits `written` only after the worker has made the sample durable.
A worker dies with its parent (PR_SET_PDEATHSIG): the coordinator, or the fork server it was forked from, which
exits with the coordinator (builder/run/worker_start.py); so a SIGKILLed run leaves no writer behind. It ignores
SIGINT/SIGTERM: the coordinator decides when it stops.
"""

from __future__ import annotations

import multiprocessing.util as mp_util
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.errors import SampleError, is_no_space
from builder.extract.backends import registry as backends
from builder.extract.backends.base import Backend, Failure, Request, States, Unavailable
from builder.extract.model import Extractor
from builder.run import testhook
from builder.run.messages import (
    Abandoned,
    Deferred,
    Dropped,
    Exit,
    Failed,
    Fatal,
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
    WorkerSettings,  # noqa: F401 - (re-exported)
    Written,
)
from builder.run.prctl import die_with_parent
from builder.run.regenerate import Regenerated, TurnLoop
from builder.run.standby import Flags
from builder.run.worker_start import server_pid
from builder.store.segment import Location, SegmentWriter, StagedGroup, new_segment_name


def worker_main(settings: WorkerSettings, conn, flags: Flags) -> None:  # pragma: no cover - subprocess
    """Takes tasks from, and reports to, its own pipe to the coordinator (one per worker, so a worker killed
    mid-message damages nothing but its own pipe)."""
    try:
        _worker_loop(settings, conn, flags)
    except (EOFError, BrokenPipeError):  # the coordinator is gone
        os._exit(1)
    # done, everything reported (Exit) and durable: leave without the interpreter's teardown (torch's and the
    # model's: most of a second the coordinator would wait for at the end of every run), after what a spawned
    # process runs on its way out (multiprocessing's finalizers: semaphores, e.g. tqdm's lock, given back)
    mp_util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _SendLocked:
    """The worker's end of its pipe, shared by this thread and the committer: whole messages, never interleaved
    (only this thread receives)."""

    def __init__(self, conn):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, msg: object) -> None:
        with self._lock:
            self._conn.send(msg)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self._conn.poll(timeout)

    def recv(self) -> object:
        return self._conn.recv()


def run_hosted(settings: WorkerSettings, conn, flags) -> None:
    """The worker loop on a thread of a process that is not the coordinator's child (a Ray actor,
    builder/run/ray_pool.py): no parent-death signal, no signal handlers; `conn` and `flags` are the host's."""
    try:
        _worker_loop(settings, conn, flags, hosted=True)
    except (EOFError, BrokenPipeError):
        pass


def _worker_loop(settings: WorkerSettings, conn, flags: Flags, hosted: bool = False) -> None:  # pragma: no cover
    conn = _SendLocked(conn)
    if not hosted:
        die_with_parent(signal.SIGKILL)  # the coordinator, or the fork server (which exits with the coordinator)
        if os.getppid() != (server_pid() or settings.coordinator_pid):  # that parent died while this one started
            os._exit(1)
        # The coordinator decides when to stop: a Ctrl-C or SIGTERM to the whole process group must not kill a
        # worker with a sample in hand. (Spawned with both ignored already; this keeps it so.)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wid = settings.worker
    try:
        torch.set_num_threads(max(1, settings.threads))
        ex, backend = _open_backend(settings, conn)
        if settings.regenerate is not None:  # a regenerating build: a sample is one request per generated turn
            backend = TurnLoop(backend, ex.tokenizer, settings.regenerate)
    except Exception as e:  # noqa: BLE001
        conn.send(Fatal(wid, f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(wid, ex.fingerprint, ex.metadata(), backend.capacity,
                    str(ex.device) if backends.get(settings.backend).loads_model else ""))
    group = _Group(settings, conn, flags, ex, backend)
    stopping = False
    try:
        while True:
            for outcome in backend.collect(0.0):
                group.take(outcome)
            if group.staged and (group.full() or flags.stop):
                group.flush()
                continue
            busy = backend.in_flight() > 0
            if not stopping and backend.in_flight() < backend.capacity:
                # idle: block for the next task; busy: only look; staged: wait at most the group's time bound
                timeout = 0.0 if busy else (group.wait_seconds() if group.staged else None)
                if conn.poll(timeout):
                    task: Task | Stop = conn.recv()
                    if isinstance(task, Stop):
                        stopping = True
                    elif flags.stop:
                        conn.send(Skipped(wid, task.sample_id))
                    else:
                        group.submit(task)
                    continue
                if not busy:  # no task within the group's time bound: make what is staged durable
                    group.flush()
                    continue
            if busy:  # the engine has them all: wait for the next outcome
                if flags.stop:
                    backend.abandon_waiting()
                for outcome in backend.collect(0.05):
                    group.take(outcome)
                continue
            if stopping:
                break
        group.flush()
        group.seal()
    finally:
        backend.close()
    conn.send(Exit(settings.worker))


def _open_backend(settings: WorkerSettings, conn=None) -> tuple[Extractor, Backend]:  # noqa: ANN001
    """The extractor (model metadata and token checks) and the backend that runs the forward passes, opened as
    its spec says (builder/extract/backends/registry.py). A server backend checks the server again each time it
    comes back (`ServerChecked` to the coordinator on `conn`)."""
    recheck = None
    if settings.server_check is not None:
        identity = settings.server_check  # (the engine's identity check: serving.ServerIdentity)

        def recheck() -> None:
            found = identity.check()
            if conn is not None:
                conn.send(ServerChecked(settings.worker, found))

    return backends.get(settings.backend).open(settings, recheck)


GROUP_BYTES = 32 << 20  # encoded bytes a worker stages before making them durable in one barrier
GROUP_SAMPLES = int(os.environ.get("HSBUILD_GROUP_SAMPLES", "256"))  # ... or this many samples
# benchmarks only (tools/bench_pipeline.py): 0 commits each group before extracting on, as before overlap
OVERLAP = os.environ.get("HSBUILD_COMMIT_OVERLAP", "1") != "0"
GROUP_SECONDS = float(os.environ.get("HSBUILD_GROUP_SECONDS", "3"))  # ... or once its oldest staged sample
# has waited this long (what a crash can cost: that much extraction, redone)
# groups being made durable at once: a second group's writes and fsyncs start while the first waits on the disk
# (fsync latency, high on network storage, is overlapped); each group still commits its samples only once its
# own bytes are durable
COMMITS_IN_FLIGHT = max(1, int(os.environ.get("HSBUILD_COMMITS_IN_FLIGHT", "2")))


@dataclass
class _StagedSample:
    task: Task
    location: Location
    truncated: int
    t0: float
    generation: dict | None = None  # a regenerated sample's (its written event's detail)


class _Group:
    """A worker's segment and the group of samples it has staged but not yet made durable.

    Samples are extracted and encoded into memory (`Staged`), then made durable together (`SegmentWriter.commit`:
    one barrier) on a committer thread and only then reported `Written`, so the engine is held up neither by
    one fsync per sample nor by the group's barrier, and small samples share files. Memory: at most about
    (COMMITS_IN_FLIGHT + 1) x GROUP_BYTES of encoded data (the groups committing and the group staging) plus the
    sample in hand."""

    def __init__(self, settings: WorkerSettings, conn, flags: Flags, ex: Extractor, backend: Backend):
        self.settings, self.conn, self.flags, self.ex, self.backend = settings, conn, flags, ex, backend
        self.in_flight: dict[str, tuple[Task, object, object, float]] = {}  # key -> task, ids, mask, t0
        self.wid = settings.worker
        self.writer: SegmentWriter | None = None
        self.items: list[_StagedSample] = []
        self.first_staged = 0.0
        self.byte_limit = GROUP_BYTES  # lowered on a small volume: a group never holds more than 1% of it
        # up to COMMITS_IN_FLIGHT groups commit (write + fsync, on these threads) while the next is staged: the
        # forward passes do not wait for the disk
        self._committer = ThreadPoolExecutor(COMMITS_IN_FLIGHT, thread_name_prefix="hsbuild-commit")
        self._pending: deque[Future] = deque()
        self._committing: dict[int, int] = {}  # group number -> its encoded bytes, not yet on the disk
        self._committing_lock = threading.Lock()
        self._groups = 0

    @property
    def staged(self) -> int:
        return len(self.items)

    @property
    def committing_bytes(self) -> int:
        """Encoded bytes of the groups being committed (not yet counted by the volume's own figures)."""
        with self._committing_lock:
            return sum(self._committing.values())

    def _settled(self, no: int) -> None:
        """Group `no` is on the disk, or nothing of it stayed there."""
        with self._committing_lock:
            self._committing.pop(no, None)

    def full(self) -> bool:
        w = self.writer
        return w is not None and (w.staged_bytes >= self.byte_limit or w.staged >= GROUP_SAMPLES
                                  or time.monotonic() - self.first_staged >= GROUP_SECONDS)

    def wait_seconds(self) -> float:
        """How long to wait for another task before flushing what is staged."""
        return 0.0 if not self.items else max(0.0, min(0.05, GROUP_SECONDS - (time.monotonic() - self.first_staged)))

    def _fail(self, task: Task, reason: str, message: str) -> None:
        self.conn.send(Failed(self.wid, task.sample_id, task.attempt, task.fingerprint, reason, message))

    def submit(self, task: Task) -> None:
        """Check the sample's tokens and hand it to the backend (`Started`); its outcome comes via `take`."""
        self.conn.send(Started(self.wid, task.sample_id, task.attempt, task.fingerprint, time.time()))
        testhook.before_task(self.wid)  # (HSBUILD_TEST_HOLD: holds at its K-th task until the test lets it go)
        t0 = time.perf_counter()
        regen = isinstance(self.backend, TurnLoop)
        try:  # (a regenerating build's prompt is never cut: its positions bound the response instead)
            ids = self.ex.check(task.input_ids, None if regen else self.settings.max_tokens)
        except SampleError as e:
            self._fail(task, e.reason, str(e))
            return
        self.in_flight[task.sample_id] = (task, ids, task.loss_mask[: ids.shape[0]], t0)
        if regen:
            self.backend.start(task.sample_id, ids, task.conversation)
        else:
            self.backend.submit(Request(task.sample_id, ids, task.origin))

    def take(self, outcome) -> None:
        entry = self.in_flight.pop(outcome.key, None)
        if entry is None:
            return
        task, ids, mask, t0 = entry
        match outcome:
            case Regenerated(detail=info) if info["finish_reason"] == "length" and self.settings.regenerate.drop_truncated:
                self.conn.send(Dropped(self.wid, task.sample_id, task.attempt, task.fingerprint, info))
            case Regenerated(input_ids=ids, loss_mask=mask, aux=aux, final=final, detail=info):
                self.stage(task, ids, mask, aux, final, t0, info)
            case States(aux=aux, final=final):
                self.stage(task, ids, mask, aux, final, t0)
            case Failure(reason=reason, message=message):
                self._fail(task, reason, message)
            case Unavailable(message=message, refused=refused, need_bytes=need, too_small=too_small):
                self.conn.send(Unreachable(self.wid, task.sample_id, task.attempt, task.fingerprint, message,
                                           refused, need, too_small))

    def stage(self, task: Task, ids, mask, aux, final, t0: float, generation: dict | None = None) -> None:
        s, wid = self.settings, self.wid
        try:
            if self.writer is None:
                try:
                    self.writer = SegmentWriter(Path(s.data_root), new_segment_name(s.run_id, wid),
                                                self.ex.hidden_size, len(self.ex.aux_layers), s.chunk_tokens,
                                                s.codec, s.dtype, s.quantize,
                                                run_record=(s.history_ordinal, s.run_id) if s.history_ordinal
                                                else None).create()
                except OSError as e:
                    if is_no_space(e):  # like a full disk during a write: pause, retry once space returns
                        self.conn.send(NoSpace(wid, task.sample_id, task.attempt, task.fingerprint,
                                               f"creating a segment: {e}"))
                        return
                    raise
            projected = int(ids.nbytes + mask.nbytes + aux.numel() * aux.element_size()
                            + final.numel() * final.element_size()) + self.writer.staged_bytes + self.committing_bytes
            st = os.statvfs(s.data_root)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            self.byte_limit = max(1, min(GROUP_BYTES, total // 100))
            over_flood = s.flood < 1.0 and (total - free + projected) / total >= s.flood
            under_min_free = s.min_free > 0 and free - projected < s.min_free
            if over_flood or under_min_free:  # would cross flood: not staged; what is staged is written first
                self.flush(wait=True)
                self.conn.send(Deferred(wid, task.sample_id, task.attempt, task.fingerprint,
                                        projected - (self.writer.staged_bytes if self.writer else 0), total, free))
                return
            # tokens cut by --max-tokens (a regenerated sample: none; its manifest keeps its generation's figures)
            cut = 0 if generation is not None else int(task.input_ids.shape[0]) - int(ids.shape[0])
            loc = self.writer.add(ids, mask, aux, final, sample_id=task.sample_id, fingerprint=task.fingerprint,
                                  attempt=task.attempt, extra={"truncated": cut,
                                                               **({"generation": generation} if generation else {})})
            if not self.items:
                self.first_staged = time.monotonic()
            self.items.append(_StagedSample(task, loc, cut, t0, generation))
            self.conn.send(Staged(wid, task.sample_id))
        except SampleError as e:
            self._fail(task, e.reason, str(e))
        except Exception as e:  # noqa: BLE001 - one bad sample must not end the run
            self._fail(task, "error", traceback.format_exception_only(type(e), e)[-1].strip())

    def flush(self, wait: bool = False) -> None:
        """Hand the staged group to a committer thread, which makes it durable and then reports each sample
        (`Written`), while this thread goes on extracting and staging the next group. At most COMMITS_IN_FLIGHT
        groups commit at once: a flush first waits for the oldest commit when that many are under way. With
        `wait`, returns once this group is committed too."""
        if self.items and self.writer is not None:
            self.drain(COMMITS_IN_FLIGHT - 1)
            items, self.items = self.items, []
            group = self.writer.detach()
            self._groups += 1
            with self._committing_lock:
                self._committing[self._groups] = sum(it.location.nbytes for it in items)
            self._pending.append(self._committer.submit(self._commit, items, group, self._groups))
        if wait or not OVERLAP:
            self.drain()

    def drain(self, keep: int = 0) -> None:
        """Wait until at most `keep` groups are being committed (default: none)."""
        while len(self._pending) > keep:
            self._pending.popleft().result()  # _commit reports its failures itself and never raises

    def _commit(self, items: list[_StagedSample], group: StagedGroup | None, no: int) -> None:
        reported: set[int] = set()  # items already reported (written, failed): never reported again
        try:
            self._commit_group(items, group, no, reported)
        except BaseException as e:  # noqa: BLE001 - a sample must never go unreported
            for i, it in enumerate(items):
                if i not in reported:
                    self._fail(it.task, "error", f"writing its group: {type(e).__name__}: {e}")
        finally:
            self._settled(no)

    def _commit_group(self, items: list[_StagedSample], group: StagedGroup | None, no: int,
                      reported: set[int] | None = None) -> None:
        """Make the group durable, then report each sample (`Written`, checked first with --verify-after-write;
        its index goes into `reported`). The pause point: never starts while writers are paused."""
        reported = set() if reported is None else reported
        s, wid, w = self.settings, self.wid, self.writer
        assert w is not None and group is not None
        while not self.flags.gate_open and not self.flags.stop:
            time.sleep(0.05)
        if not self.flags.gate_open:  # stopping while paused: nothing of the group is written
            for it in items:
                self.conn.send(Abandoned(wid, it.task.sample_id))
            return
        try:
            w.commit(group)  # a failed group leaves nothing behind (SegmentWriter.commit)
        except OSError as e:
            self._settled(no)  # nothing of it stayed on disk
            for it in items:
                t = it.task
                if is_no_space(e):
                    self.conn.send(NoSpace(wid, t.sample_id, t.attempt, t.fingerprint, str(e)))
                else:
                    self._fail(t, "error", f"writing its group: {type(e).__name__}: {e}")
            return
        self._settled(no)  # on disk now: the volume's own figures count it (not twice in a projection)
        retries = None  # the check's default (builder.store.readback.RETRIES)
        for i, it in enumerate(items):
            t, loc = it.task, it.location
            verified, check_error = False, None
            if s.verify_after_write:
                res = self._check(loc, retries)
                if res.finding is not None:  # evidence about the bytes: the sample is damaged
                    reported.add(i)
                    self._fail(t, res.finding[0], res.finding[1])
                    continue
                if res.error is not None:  # the check could not run: written, not checked, never `failed`
                    check_error = res.error
                    # the rest of the group: one retry each (a device gone would stall the commit ~1 s a sample)
                    retries = 1
                verified = res.error is None
            reported.add(i)
            self.conn.send(Written(wid, t.sample_id, t.attempt, t.fingerprint, loc, it.truncated,
                                   time.perf_counter() - it.t0, verified, check_error, it.generation))

    def _check(self, loc: Location, retries: int | None):
        """--verify-after-write: read the durable sample back and compare its checksums (`SampleCheck`). A read
        that cannot run (EIO, EMFILE, ENOMEM, ...) is retried with a short backoff (`check_with_retries`), then
        returned as `error`: that says nothing about the bytes (docs/design.md section 9)."""
        from builder.store import readback  # noqa: PLC0415

        s = self.settings

        def check():
            return readback.check_sample(Path(s.data_root), loc.segment, loc.token_start, loc.num_tokens,
                                       loc.checksums, s.chunk_tokens)

        return readback.check_with_retries(check, **({} if retries is None else {"retries": retries}))

    def seal(self) -> None:
        self.drain()
        self._committer.shutdown()
        if self.writer is None:
            return
        try:
            self.conn.send(Sealed(self.wid, self.writer.seal()))
        except OSError as e:
            self.conn.send(SealFailed(self.wid, self.writer.name, str(e)))
