"""Extraction worker process: loads the model, extracts, writes samples into its own segment.

Workers never touch the event log. They report to the coordinator over their own pipe, in the typed messages
of builder.run.messages; the coordinator commits `written` only after the worker has made the sample durable.
A worker dies with its coordinator (PR_SET_PDEATHSIG), so a SIGKILLed run leaves no writer behind, and ignores
SIGINT/SIGTERM: the coordinator decides when it stops.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.errors import SampleError
from builder.extract.model import Extractor
from builder.run.messages import (
    Abandoned,
    Deferred,
    Exit,
    Failed,
    Fatal,
    NoSpace,
    Ready,
    Sealed,
    SealFailed,
    Skipped,
    Started,
    Stop,
    Task,
    Written,
)
from builder.store.segment import SegmentWriter, new_segment_name


@dataclass
class WorkerSettings:
    build_root: str
    data_root: str
    run_id: str
    worker: int
    model: str
    aux_layers: list[int]
    dtype: str
    device: str
    codec: str
    chunk_tokens: int
    max_tokens: int | None
    threads: int
    verify_after_write: bool = False
    flood: float = 0.95
    coordinator_pid: int = 0
    min_free: int = 0


class Flags:
    """Run-wide flags shared with the workers, lock-free (a RawArray of bytes): a worker killed at any moment
    cannot leave a lock held that would stall the others (multiprocessing's Queue and Event can)."""

    def __init__(self, ctx):
        self._a = ctx.RawArray("b", 2)
        self._a[1] = 1

    @property
    def stop(self) -> bool:
        return bool(self._a[0])

    @stop.setter
    def stop(self, v: bool) -> None:
        self._a[0] = int(v)

    @property
    def gate_open(self) -> bool:
        """Writes may start. Closed while writers are paused (disk watermarks)."""
        return bool(self._a[1])

    @gate_open.setter
    def gate_open(self, v: bool) -> None:
        self._a[1] = int(v)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _is_nospace(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def worker_main(settings: WorkerSettings, conn, flags: Flags) -> None:  # pragma: no cover - subprocess
    """Takes tasks from, and reports to, its own pipe to the coordinator (one per worker, so a worker killed
    mid-message damages nothing but its own pipe)."""
    try:
        _worker_loop(settings, conn, flags)
    except (EOFError, BrokenPipeError):  # the coordinator is gone
        os._exit(1)


def _worker_loop(settings: WorkerSettings, conn, flags: Flags) -> None:  # pragma: no cover - subprocess
    _die_with_parent()
    if os.getppid() != settings.coordinator_pid:  # the coordinator died while this process was starting
        os._exit(1)
    # The coordinator decides when to stop: a Ctrl-C or SIGTERM to the whole process group must not kill a
    # worker with a sample in hand. (Spawned with both ignored already; this keeps it so.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wid = settings.worker
    try:
        torch.set_num_threads(max(1, settings.threads))
        ex = Extractor(settings.model, settings.aux_layers or None, settings.dtype, settings.device)
    except Exception as e:  # noqa: BLE001
        conn.send(Fatal(wid, f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(wid, ex.fingerprint, ex.metadata()))
    writer: SegmentWriter | None = None
    while True:
        task: Task | Stop = conn.recv()
        if isinstance(task, Stop):
            break
        if flags.stop:
            conn.send(Skipped(wid, task.sample_id))
            continue
        conn.send(Started(wid, task.sample_id, task.attempt, task.fingerprint, time.time()))
        t0 = time.perf_counter()
        try:
            ids = ex.check(task.input_ids, settings.max_tokens)
            mask = task.loss_mask[: ids.shape[0]]
            aux, final = ex.extract(ids)
            # Pause point: the coordinator may hold the gate shut (disk watermarks). Never mid-write.
            while not flags.gate_open and not flags.stop:
                time.sleep(0.05)
            if not flags.gate_open:
                conn.send(Abandoned(wid, task.sample_id))
                continue
            if writer is None:
                try:
                    writer = SegmentWriter(Path(settings.data_root), new_segment_name(settings.run_id, wid),
                                           ex.hidden_size, len(ex.aux_layers), settings.chunk_tokens,
                                           settings.codec, settings.dtype).create()
                except OSError as e:
                    if _is_nospace(e):  # like a full disk during a write: pause, retry once space returns
                        conn.send(NoSpace(wid, task.sample_id, task.attempt, task.fingerprint,
                                          f"creating a segment: {e}"))
                        continue
                    raise
            projected = int(ids.nbytes + mask.nbytes + aux.numel() * aux.element_size()
                            + final.numel() * final.element_size())
            st = os.statvfs(settings.data_root)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            over_flood = settings.flood < 1.0 and (total - free + projected) / total >= settings.flood
            under_min_free = settings.min_free > 0 and free - projected < settings.min_free
            if over_flood or under_min_free:
                # would cross flood: not started
                conn.send(Deferred(wid, task.sample_id, task.attempt, task.fingerprint, projected, total, free))
                continue
            start = writer.cursor
            try:
                loc = writer.write(ids, mask, aux, final)
            except OSError as e:
                writer.discard(start, int(ids.shape[0]))
                if _is_nospace(e):
                    conn.send(NoSpace(wid, task.sample_id, task.attempt, task.fingerprint, str(e)))
                    continue
                raise
            verified = False
            if settings.verify_after_write:
                from builder.verify.checks import check_location  # noqa: PLC0415

                finding = check_location(Path(settings.data_root), loc.segment, loc.token_start, loc.num_tokens,
                                         loc.checksums, settings.chunk_tokens)
                if finding is not None:
                    conn.send(Failed(wid, task.sample_id, task.attempt, task.fingerprint, finding[0], finding[1]))
                    continue
                verified = True
            conn.send(Written(wid, task.sample_id, task.attempt, task.fingerprint, loc,
                              int(task.input_ids.shape[0]) - loc.num_tokens, time.perf_counter() - t0, verified))
        except SampleError as e:
            conn.send(Failed(wid, task.sample_id, task.attempt, task.fingerprint, e.reason, str(e)))
        except Exception as e:  # noqa: BLE001 - one bad sample must not end the run
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            conn.send(Failed(wid, task.sample_id, task.attempt, task.fingerprint, "error", tb))
    if writer is not None:
        try:
            conn.send(Sealed(wid, writer.seal()))
        except OSError as e:
            conn.send(SealFailed(wid, writer.name, str(e)))
    conn.send(Exit(wid))
