"""Dispatch: which worker holds which sample, and the messages to each worker.

`Dispatcher` owns the samples still to do and, per worker, what it was handed, what it has in hand, what it holds
in its unflushed group, how many it may hold, and whether it was told to stop. It is exact per worker, so the
samples of a worker that died or was lost are never lost track of. The run's other parts tell it what a worker
reported (`ready`, `started`, `stage`, `done`, `exited`) and ask it what it knows; nothing else touches its state.
Each worker's messages are sent by an `Outbox`, from a thread of its own (a worker that stops reading never blocks
the run's loop).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from builder.run.messages import Stop, Task

if TYPE_CHECKING:
    from builder.extract.source import Sample

PER_WORKER = 2  # samples handed to a worker at once: one in hand, one waiting ...
QUEUE_SAMPLES = 64  # ... or more, while small: up to this many
QUEUE_TOKENS = 8192  # ... holding at most this many tokens


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


class Dispatcher:
    """Who has which sample (see the module's docstring). `samples`: the run's samples to do, by id, in the
    order they go out; `attempts`: each one's starts so far (the plan's); `origins`: an import's dump file per
    sample (sent with its task)."""

    def __init__(self, samples: Mapping[str, Sample], attempts: Mapping[str, int],
                 origins: Mapping[str, str] | None = None):
        self._samples = samples
        self._origins = origins or {}
        self._pending: deque[str] = deque(samples)
        self._attempts: dict[str, int] = dict(attempts)
        self._outboxes: dict[int, Outbox] = {}
        self._assigned: dict[int, list[str]] = {}  # handed to the worker, not yet reported back, in order
        self._alive: set[int] = set()
        self._ready: set[int] = set()
        self._current: dict[int, str] = {}  # the sample a worker announced `started`
        self._told_to_stop: set[int] = set()
        self._staged: dict[int, list[str]] = {}  # extracted, in the worker's unflushed group
        self._window: dict[int, int] = {}  # samples a worker may hold (its backend's capacity + 1)
        self._in_flight: set[str] = set()  # started, not yet staged or done

    # -- the workers -------------------------------------------------------------------------------------------
    def add(self, w: int, conn: Connection) -> None:
        """Worker `w` is started; `conn` is the run's end of its pipe (its tasks and stops go there)."""
        self._outboxes[w] = Outbox(conn, f"hsbuild-worker-{w}")
        self._assigned[w] = []
        self._alive.add(w)

    def ready(self, w: int, capacity: int) -> None:
        """Worker `w` loaded its model: it takes samples now, all its requests in flight and one waiting."""
        self._ready.add(w)
        self._window[w] = max(PER_WORKER, capacity + 1)

    def exited(self, w: int) -> None:
        """Worker `w` said `exit`: it holds nothing more (what it held was reported before)."""
        self._alive.discard(w)

    def alive(self) -> list[int]:
        """The workers still counted as running, in order."""
        return sorted(self._alive)

    def is_alive(self, w: int) -> bool:
        return w in self._alive

    def going_on(self) -> int:
        """Workers still running that were not told to stop (the ones that take samples)."""
        return len(self._alive - self._told_to_stop)

    # -- the samples -------------------------------------------------------------------------------------------
    def started(self, w: int, sid: str, attempt: int) -> None:
        self._current[w] = sid
        self._in_flight.add(sid)
        self._attempts[sid] = attempt

    def stage(self, w: int, sid: str) -> None:
        """The worker holds `sid` in its group (not durable): it no longer counts against its window."""
        if sid in self._assigned.get(w, []):
            self._assigned[w].remove(sid)
        if self._current.get(w) == sid:
            del self._current[w]
        self._staged.setdefault(w, []).append(sid)
        self._in_flight.discard(sid)

    def done(self, w: int, sid: str, requeue: bool = False) -> None:
        """`sid` is off worker `w`'s hands: written or failed, or (`requeue`) back to the front of pending."""
        if sid in self._assigned.get(w, []):
            self._assigned[w].remove(sid)
        if sid in self._staged.get(w, []):
            self._staged[w].remove(sid)
        if self._current.get(w) == sid:
            del self._current[w]
        self._in_flight.discard(sid)
        if requeue:
            self._pending.appendleft(sid)

    def in_hand(self, w: int) -> str | None:
        """The sample worker `w` announced `started` and has not reported back."""
        return self._current.get(w)

    def handed(self, w: int, sid: str) -> bool:
        """`sid` was handed to worker `w` and not staged or reported back."""
        return sid in self._assigned.get(w, [])

    def attempt(self, sid: str) -> int | None:
        return self._attempts.get(sid)

    def pending(self) -> int:
        return len(self._pending)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def take_back(self, w: int, keep: str | None = None) -> list[str]:
        """Worker `w` is gone: out of the dispatch, and every sample it held (queued to it, in hand, or staged in
        its group and never made durable) back to the front of pending, in order, except `keep`. Returns them."""
        self._alive.discard(w)
        self._current.pop(w, None)
        held = list(dict.fromkeys([*self._assigned.pop(w, []), *self._staged.pop(w, [])]))
        self._assigned[w] = []
        self._in_flight.difference_update(held)
        back = [sid for sid in held if sid != keep]
        self._pending.extendleft(reversed(back))
        return back

    # -- sending -----------------------------------------------------------------------------------------------
    def hand_out(self, gate: Callable[[], str | None]) -> str | None:
        """Hand out samples: its window to each ready worker (one in hand, one waiting), more while they are
        small (up to QUEUE_SAMPLES and QUEUE_TOKENS queued), so a worker always has its next sample at hand and
        can group many small ones into one durable write. `gate` is asked before every sample (fresh disk
        figures): a reason it returns stops the handing out, and is returned (the run pauses)."""
        assigned = self._assigned
        for w in sorted(self._ready & self._alive - self._told_to_stop, key=lambda k: len(assigned[k])):
            while self._pending and (len(assigned[w]) < self._window.get(w, PER_WORKER) or (
                    len(assigned[w]) < QUEUE_SAMPLES
                    and sum(self._samples[x].num_tokens for x in assigned[w])
                    + self._samples[self._pending[0]].num_tokens <= QUEUE_TOKENS)):
                pause = gate()
                if pause is not None:
                    return pause
                sid = self._pending.popleft()
                s = self._samples[sid]
                assigned[w].append(sid)
                self._outboxes[w].send(Task(sid, self._attempts.get(sid, 0) + 1, s.fingerprint, s.input_ids,
                                            s.loss_mask, self._origins.get(sid), s.conversation))
        return None

    def idle(self, w: int, lost_ok: bool = False) -> bool:
        """Nothing left for worker `w`: none pending, none handed to it. Where a lost worker's samples go back
        to pending and the run goes on (`lost_ok`: Ray), an idle worker also waits until no other worker still
        holds samples to extract: stopped early, it could not take back a lost node's samples."""
        if self._pending or self._assigned.get(w):
            return False
        return not lost_ok or not any(self._assigned.get(x) for x in self._alive if x != w)

    def stop_idle(self, stopping: bool, lost_ok: bool = False) -> None:
        """A sentinel to each worker that has nothing more to do (all of them when `stopping`); its staged group
        is flushed on Stop."""
        for w in sorted(self._alive - self._told_to_stop):
            if stopping or self.idle(w, lost_ok):
                self._stop(w)

    def stop_all(self, running: Iterable[int]) -> None:
        """Tell each of the `running` workers not told yet to stop (the run is ending)."""
        for w in running:
            if w not in self._told_to_stop:
                self._stop(w)

    def _stop(self, w: int) -> None:
        self._outboxes[w].send(Stop())
        self._told_to_stop.add(w)

    def close(self) -> None:
        """Every outbox's thread ended (a send to a dead worker fails), its pipe closed."""
        for box in self._outboxes.values():
            box.close()
