"""Dispatch bookkeeping: which worker holds which sample, the messages to each worker, and stopping them.

`Dispatch` is exact per worker, so the samples of a worker that died or was lost are never lost track of;
`Outbox` sends to one worker from a thread of its own (a worker that stops reading never blocks the run's loop);
`DispatchMixin` is the part of the Coordinator (builder/run/coordinator.py) that hands samples out, pauses on the
disk watermarks, and takes a gone worker's samples back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from builder.errors import UsageError
from builder.log.events import Event, detail
from builder.run.messages import Stop, Task

if TYPE_CHECKING:
    from builder.extract.source import Sample
    from builder.run.coordinator import RunReport
    from builder.run.standby import Flags

PER_WORKER = 2  # samples handed to a worker at once: one in hand, one waiting ...
QUEUE_SAMPLES = 64  # ... or more, while small: up to this many
QUEUE_TOKENS = 8192  # ... holding at most this many tokens
STOP_GRACE_SECONDS = 30.0  # after Ctrl-C/SIGTERM, how long workers get to finish their sample (HSBUILD_STOP_GRACE)
ABORT_GRACE_SECONDS = 120.0  # after a worker died, how long the others get
SHUTDOWN_SECONDS = 10.0  # leaving the main loop early (an error): how long all workers together get to exit


@dataclass
class Dispatch:
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


class Outbox:
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


def stop_workers(procs: dict[int, mp.process.BaseProcess], outboxes: dict[int, Outbox], st: Dispatch,
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


def stop_grace(value: float | None) -> float:
    """Seconds the workers get to finish their sample in hand after a stop request (--stop-grace, else
    $HSBUILD_STOP_GRACE, else STOP_GRACE_SECONDS)."""
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


class DispatchMixin:
    """The Coordinator's dispatch: handing samples out, pausing for space, and taking back what a worker that
    is gone held. (Mixed into Coordinator: uses its space monitor, events, echo and state.)"""

    def _dispatch(self, st: Dispatch, outboxes: dict, by_id: dict[str, Sample], flags: Flags,
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

    @staticmethod
    def _take_back(w: int, st: Dispatch, keep: str | None = None) -> list[str]:
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

    def _worker_lost(self, w: int, why: str, st: Dispatch) -> None:
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

    def _give_up_on(self, st: Dispatch, procs: dict[int, mp.process.BaseProcess], grace: float) -> None:
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

    def _worker_died(self, w: int, code: int | None, st: Dispatch, report: RunReport,
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
