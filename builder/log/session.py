"""The owner session: what every command that writes a build shares (a run, a verify sweep, gc, export, skip).

    with OwnerSession(lay, "verify", run_id, status=sweep.status, echo=echo) as s:   # the build lock
        ...                                   # validate input: nothing opened yet; `status` says "starting"
        s.open()                              # the log, batched commits, signals, the stall watch
        s.emit(Event(...)); s.flush()
        if s.stop_requested: ...

One place decides, for all of them:
- **metrics** (`metrics=HOST:PORT`, `hsbuild run --metrics`): Prometheus metrics made from the same `status`,
  served from the lock on until the session closes (log/metrics.py);
- **the lock** (`BuildLock`) is taken on entry and released last, after the log is closed;
- **queries** from other shells are answered from the moment the lock is held: `status` says the phase while
  the command starts ("starting: reading the source"), `sql` asks the client to wait (it retries within its
  --timeout); once the log is open, `status` is the command's own plus the session's (stall, phase);
- **signals**: the first SIGINT/SIGTERM only records a stop request (the command stops at a safe point and
  `announce_stop` says so once, from the main thread, never from the handler); a second one marks the lock record
  `interrupted` and exits 130 at once (nothing uncommitted is ever referenced, so that is still safe). The
  handlers stay installed until the lock is released: a signal in the last moments is still a request. Log
  commits run in a thread while the main thread waits for them (`_off_main`): a commit that a stalled volume
  holds in the kernel (where no handler runs) does not hold the main thread, so Ctrl-C is taken and said at
  once, with what the stop waits for;
- **stalls** (`log/stall.py`): writes, fsyncs or log commits of the build that have not returned for
  HSBUILD_STALL_S seconds. The output says `STALLED: ...` at once and every 30 s while it lasts; `status`
  answers within 2 s from what the session holds in memory when the log itself is stuck (a cached status plus the
  stall), `sql` answers from the last snapshot of the log, naming the stall; `stalled`/`unstalled` events (with
  the duration) are committed once the log can commit again. `stalled` tells the command to send no new work.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from builder.layout import BuildLayout
from builder.log.events import Event, EventBatch, EventLog, detail, open_log
from builder.log.kinds import EventKind
from builder.log.lock import BuildLock, note_interrupted
from builder.log.metrics import MetricsServer
from builder.log.server import QueryServer
from builder.log.stall import Stall, StallWatch
from builder.progress import Echo, quiet

EXIT_INTERRUPTED = 130
STATUS_WAIT_S = 1.0  # a log commit pending this long: status answers from the last one, marked stale (as_of)
STATUS_MAX_WAIT_S = 8.0  # a status that takes longer to compute (a huge log) is answered from the last one too
STATUS_SHARE_S = 1.0  # a status computation begun this long before a question answers it too
SAY_AGAIN_S = 30.0  # how often a stall is said again while it lasts
SAY_FROM_HANDLER_S = 1.0  # how long a second Ctrl-C waits for `echo` to say why the exit waits (a stall)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class OwnerSession:
    def __init__(self, lay: BuildLayout, purpose: str, run_id: str | None = None, *, take_over: bool = False,
                 echo: Echo | None = None, status: Callable[[], dict] | None = None,
                 before_commit: Callable[[], None] | None = None, watch: list[Path] | tuple = (),
                 stall_s: float | None = None, signals: bool = True, metrics: str | None = None):
        """`echo`: what the session says (its metrics address, stalls, a stop), silent without one: the session
        never writes to a terminal itself; `status`: the command's own status (it may query the log); `watch`:
        directories beside the build's root whose writes are probed for stalls (e.g. a staging folder);
        `signals`: take SIGINT and SIGTERM (only in the main thread, with `open` or `take_signals`); `metrics`:
        HOST:PORT where Prometheus metrics (of `status`) are served from the lock on (log/metrics.py)."""
        self.lay, self.purpose = lay, purpose
        self.run_id = run_id or uuid.uuid4().hex
        self.take_over, self.echo = take_over, echo or quiet
        self.status_fn, self.before_commit = status, before_commit
        self.lock: BuildLock | None = None
        self.log: EventLog | None = None
        self.batch: EventBatch | None = None
        self.server: QueryServer | None = None
        self.phase = "starting"
        self.stop_requested = 0
        self.stop_event = threading.Event()
        self._stop_said = False
        self.stop_what = "stopping at a safe point (Ctrl-C again to exit at once; still safe)"  # said on a stop
        self._signals = signals
        self._old_handlers: dict = {}
        self._pending_events: list[Event] = []  # stall events from the watch thread, committed by the owner
        self._events_lock = threading.Lock()
        self._cached: dict = {}  # the last status computed, with its `as_of` (time.time() when it was begun)
        self._cached_t0: float | None = None  # (time.monotonic() of the same moment)
        self._status_thread: threading.Thread | None = None
        self._status_guard = threading.Lock()
        self._status_begun = 0.0  # time.monotonic() when the last status computation began
        dirs = [lay.root, *[Path(d) for d in watch]]  # (data/ is left alone: only segments live there)
        self.watch = StallWatch([d for d in dirs if Path(d).is_dir()], limit_s=stall_s, on_change=self._on_stall)
        self._said_at = 0.0
        self._ticker_stop = threading.Event()
        self.metrics_at = metrics  # host:port where Prometheus metrics are served while the session lasts
        self.metrics: MetricsServer | None = None
        self._committer: _Committer | None = None  # the thread the main thread's commits run in (`_off_main`)

    # -- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> OwnerSession:
        self.lock = BuildLock(self.lay, self.purpose, self.run_id, take_over=self.take_over).acquire()
        try:
            self.server = QueryServer(self.lock.socket_path, None, self.status, stalled=self.stall_info,
                                      commit_pending=self.commit_pending).start()
            if self.metrics_at is not None:
                self.metrics = MetricsServer(self.metrics_at, self.status).start()
                self.echo(f"metrics: http://{self.metrics.address.host}:{self.metrics.port}/metrics")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def previous_owner(self) -> dict | None:
        return self.lock.previous if self.lock is not None else None

    def open(self, log: EventLog | None = None, signals: bool = True) -> EventLog:
        """Open the log (or take `log`, already open), batch commits, watch for stalls, and take the signals
        (or later, with `take_signals`: until then Ctrl-C ends the command at once, as before it started)."""
        self.log = log or open_log(self.lay.events)
        self.batch = EventBatch(self.log, self.run_id, self.before_commit)
        if self.server is not None:
            self.server.attach(self.log)
        if signals:
            self.take_signals()
        self.watch.start()
        threading.Thread(target=self._say_while_stalled, name="hsbuild-stall-say", daemon=True).start()
        self.phase = "running"
        return self.log

    def take_signals(self) -> None:
        """From now on SIGINT/SIGTERM only ask for a stop (until the lock is released). Main thread only."""
        if self._signals and not self._old_handlers and threading.current_thread() is threading.main_thread():
            self._old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def close(self) -> None:
        """Stop watching, commit what is pending (the stall events too), stop answering, close the log, release
        the lock, and only then give the signals back."""
        self._ticker_stop.set()
        self.watch.stop()
        try:
            if self.batch is not None:
                try:
                    self.flush(force=True)
                except Exception:  # noqa: BLE001 - (the command's own flush already said what failed)
                    pass
        finally:
            try:
                if self.metrics is not None:
                    self.metrics.stop()
                if self.server is not None:
                    self.server.stop()
                if self.log is not None:
                    self.log.close()
            finally:
                try:
                    if self.lock is not None:
                        self.lock.release()
                finally:
                    for sig, handler in self._old_handlers.items():
                        signal.signal(sig, handler)
                    self._old_handlers = {}
                    if self._committer is not None:
                        self._committer.stop()

    # -- events --------------------------------------------------------------------------------------------
    def emit(self, ev: Event) -> None:
        assert self.batch is not None, "open() the session first"
        self.batch.emit(ev)

    def flush(self, force: bool = False) -> None:
        """Commit the pending events (FLUSH_SECONDS/FLUSH_EVENTS, or now with `force`); a commit that hangs is
        named by the stall watch."""
        assert self.batch is not None, "open() the session first"
        with self._events_lock:
            queued, self._pending_events = self._pending_events, []
        for ev in queued:
            self.batch.emit(ev)
        batch = self.batch
        force = force or bool(queued)
        if not batch.due(force):  # nothing to commit yet: an owner may call this for every event it emits
            return
        with self.watch.track("log commit", self.lay.events):
            self._off_main(lambda: batch.flush(force))

    def _off_main(self, fn: Callable[[], object]) -> object:
        """Run `fn` (a commit) in the session's commit thread while the main thread waits for it in slices: a
        stalled volume holds the commit in the kernel, where no signal handler runs, but not this wait. So
        Ctrl-C during a stall is taken at once and said with what it waits for (`announce_stop`). Elsewhere
        (another thread, signals not taken) `fn` runs here. One thread serves every commit of the session (one
        commit at a time: the main thread waits for each)."""
        if not self._old_handlers or threading.current_thread() is not threading.main_thread():
            return fn()
        if self._committer is None:
            self._committer = _Committer()
        done, box = self._committer.submit(fn)
        while not done.wait(0.25):
            if self.stop_requested and self.watch.current() is not None:
                self.announce_stop()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    # -- stopping ------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        """Only records the request (no I/O through Python's streams: the main thread may be writing to the same
        one). The main thread runs this while it waits for a log commit too (`_off_main`): never held by a
        stalled volume."""
        self.stop_requested += 1
        self.stop_event.set()
        if self.stop_requested >= 2:
            stall = self.watch.current()
            if stall is not None:  # the lock record's note below waits for the volume: say why nothing happens
                self._say_from_handler(f"\nexiting as soon as the stalled {stall.describe()} returns (still safe)")
            note_interrupted(self.lay, signum)  # the lock record says so: the next owner does not blame a crash
            os._exit(EXIT_INTERRUPTED)

    def _say_from_handler(self, message: str) -> None:
        """Say `message` through `echo` from the signal handler, which has interrupted the main thread anywhere
        (maybe inside a write to the very stream `echo` writes to): `echo` runs in a thread of its own, waited
        for at most SAY_FROM_HANDLER_S. Should that stream's lock be held by the interrupted write, the message
        is lost, never the exit. (threading's registry lock is an RLock: a thread can start from a handler that
        interrupted another thread's start.)"""
        def say() -> None:
            with contextlib.suppress(OSError):  # a closed stderr (the terminal gone) is no reason to say more
                self.echo(message)

        said = threading.Thread(target=say, name="hsbuild-say-exit", daemon=True)
        said.start()
        said.join(SAY_FROM_HANDLER_S)

    def request_stop(self) -> None:
        self.stop_requested = max(self.stop_requested, 1)
        self.stop_event.set()

    def announce_stop(self, what: str | None = None) -> None:
        """Say once, from the main loop (never from the handler), that a stop was asked for (`what`, else the
        command's `stop_what`); during a stall, also what the stop waits for."""
        what = what or self.stop_what
        if self.stop_requested and not self._stop_said:
            self._stop_said = True
            stall = self.watch.current()
            self.echo(f"\n{what} ..." + (f" (waiting for the stalled {stall.describe()})" if stall else ""))

    # -- stalls --------------------------------------------------------------------------------------------
    @property
    def stalled(self) -> Stall | None:
        return self.watch.current()

    def commit_pending(self) -> Stall | None:
        """The oldest log commit of this session still pending (for any time: a stall or not yet)."""
        return self.watch.pending("log commit")

    def stall_info(self) -> dict | None:
        stall = self.watch.current()
        return stall.as_dict() if stall is not None else None

    def _on_stall(self, new: Stall | None, old: Stall | None) -> None:
        """(the watch thread) A stall began or ended: say it, and queue its event for the owner's next commit."""
        if new is not None:
            self._said_at = time.monotonic()
            self.echo(f"\nSTALLED: {new.describe()}; no new work is sent until it returns, nothing is lost "
                      f"(`hsbuild doctor {self.lay.root}` names the likely causes)")
            ev = Event(EventKind.STALLED, detail=detail(**new.as_dict()))
        else:
            assert old is not None
            took = old.pending_s()
            self.echo(f"\nunstalled: {old.what} on {old.path} returned after {took:.0f} s")
            ev = Event(EventKind.UNSTALLED, detail=detail(**old.as_dict(), duration_s=round(took, 1)))
        with self._events_lock:
            self._pending_events.append(ev)

    def _say_while_stalled(self) -> None:
        while not self._ticker_stop.wait(1.0):
            stall = self.watch.current()
            if stall is not None and time.monotonic() - self._said_at >= SAY_AGAIN_S:
                self._said_at = time.monotonic()
                self.echo(f"STALLED: {stall.describe()}")

    # -- status --------------------------------------------------------------------------------------------
    def status(self) -> dict:
        """What `hsbuild status` gets from the owner. Fresh (computed after the question, or begun at most
        STATUS_SHARE_S before it) while the log answers, however long that takes up to STATUS_MAX_WAIT_S. Before
        the log is open: the phase. While the log is held (a stall, or a log commit pending STATUS_WAIT_S), or
        after STATUS_MAX_WAIT_S: the last status it could give, marked stale, with its `as_of`, and the stall."""
        base = {"running": True, "purpose": self.purpose, "run_id": self.run_id, "pid": os.getpid(),
                "phase": self.phase}
        stall = self.stall_info()
        if stall is not None:
            base["stalled"] = stall
        if self.log is None or self.status_fn is None:
            return {**self._cached, **base}
        if stall is None:
            fresh = self._fresh_status()
            if fresh is not None:
                return {**fresh, **base}
        return {**self._cached, **base, "stale": True}

    def _fresh_status(self) -> dict | None:
        """The command's status from a computation begun after the question (or shared with one begun at most
        STATUS_SHARE_S before it), computed in a thread; None when a log commit has been pending STATUS_WAIT_S
        (the log held: that thread finishes later and refreshes the cache) or STATUS_MAX_WAIT_S have passed."""
        asked = time.monotonic()
        while True:
            with self._status_guard:
                if self._cached_t0 is not None and self._cached_t0 >= asked - STATUS_SHARE_S:
                    return dict(self._cached)
                t = self._status_thread
                if t is None or not t.is_alive():
                    t = self._status_thread = threading.Thread(target=self._compute_status, name="hsbuild-status",
                                                               daemon=True)
                    self._status_begun = time.monotonic()
                    t.start()
                begun = self._status_begun
            t.join(0.05)
            pending = self.commit_pending()  # (one begun after the computation does not hold it)
            if time.monotonic() - asked >= STATUS_MAX_WAIT_S or (
                    pending is not None and pending.since <= begun and pending.pending_s() >= STATUS_WAIT_S
                    and t.is_alive()):
                return None

    def _compute_status(self) -> None:
        t0, as_of = time.monotonic(), time.time()
        try:
            got = {**self.status_fn(), "as_of": as_of}  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - a status that fails says why, it never kills the server
            got = {**self._cached, "status_error": f"{type(e).__name__}: {e}"}
        with self._status_guard:
            self._cached, self._cached_t0 = got, t0


class _Committer:
    """A daemon thread that runs the functions given to it (the session's log commits), one at a time, for the
    session's lifetime. A commit the kernel holds (a stalled volume) holds this thread, never the main one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="hsbuild-commit", daemon=True).start()

    def submit(self, fn: Callable[[], object]) -> tuple[threading.Event, dict]:
        """Queue `fn`; returns an event set once it ran and a dict that then holds its `result` or `error`."""
        done, box = threading.Event(), {}
        self._jobs.put((fn, done, box))
        return done, box

    def stop(self) -> None:
        self._jobs.put(None)  # (after the jobs queued before it; a thread stuck in the kernel stays stuck)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done, box = job
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                done.set()
