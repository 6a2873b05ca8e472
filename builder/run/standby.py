"""Worker processes started before the coordinator needs them.

A worker needs seconds before it can take a sample (torch and the model code; a Hugging Face model's classes);
so does the coordinator, on its own imports, source, plan and preflight. `Standby` starts the run's workers
first (the CLI does so before it even imports the coordinator): each imports what extraction needs, then waits
on its pipe for its `WorkerSettings`; the coordinator hands each one its settings once it has a plan (`take`).
Workers fork from the server that imported torch once, or are spawned (builder/run/worker_start.py); a fork
waits for that server's imports, so they are started from a thread while the caller goes on. Nothing here
imports torch.

A standby worker owns nothing and touches nothing until it has its settings: one never taken (nothing to do, a
refusal, an error) is killed by `close`; one whose coordinator died reads EOF on its pipe and exits.
Workers are spawned with SIGINT and SIGTERM ignored (the coordinator decides when they stop).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.connection import Connection

from builder.extract.threads import fix_threading
from builder.run.worker_start import child_setup, forked, stop_signals_ignored, worker_context


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


def start_ignoring_stop_signals(p: mp.process.BaseProcess, forked: bool = False) -> None:
    """Start a worker process that ignores SIGINT and SIGTERM from its first instruction: an ignored signal
    stays ignored across exec, so this process ignores them for the moment of the spawn. A Ctrl-C or a
    `kill -TERM -- -PGID` (systemd, `timeout`) then reaches the coordinator alone, which stops the workers at
    a safe point; none is killed with a sample in hand. (A signal arriving in those few milliseconds is
    ignored by the coordinator too.) A `forked` one inherits them ignored from its fork server
    (builder/run/worker_start.py): started as it is, from any thread."""
    if forked:
        p.start()
        return
    with stop_signals_ignored():
        p.start()


def worker_entry(settings, conn: Connection, flags: Flags, env: dict[str, str]) -> None:  # pragma: no cover
    """A worker process's target: `worker_main`, imported in the worker (the coordinator never imports torch)."""
    child_setup(env, settings.worker)
    from builder.run.worker import worker_main  # noqa: PLC0415

    worker_main(settings, conn, flags)


def standby_main(conn: Connection, flags: Flags, preload_hf: bool, env: dict[str, str],
                 worker: int) -> None:  # pragma: no cover - subprocess
    """A standby worker: import extraction's code now (and transformers' model classes for a Hugging Face
    model, unless the server it forked from did), then wait for the settings (None or EOF: not needed)."""
    child_setup(env, worker)
    from builder.run.worker import worker_main  # noqa: PLC0415 - torch and the model code, while the coordinator starts

    if preload_hf:  # (a no-op where the server it forked from imported it)
        import builder.run.zygote_hf  # noqa: F401, PLC0415

    try:
        settings = conn.recv()
    except (EOFError, OSError):
        return
    if settings is None:
        return
    worker_main(settings, conn, flags)


def loads_hf_model(cfg, backend) -> bool:  # noqa: ANN001 - a BuildConfig and its BackendSpec
    """Whether a build's workers load a Hugging Face model directory (their start then imports transformers'
    model classes: about 3 CPU-seconds)."""
    from builder.extract.spec import is_builtin  # noqa: PLC0415

    return backend.loads_model and isinstance(cfg.model, str) and not is_builtin(cfg.model)


class Standby:
    """`workers` processes started now, waiting for their settings. `preload_hf`: their model is a Hugging Face
    directory (`loads_hf_model`): transformers' model classes are imported before the settings come (once, in
    the server they fork from, or in each spawned worker)."""

    def __init__(self, workers: int, preload_hf: bool = False):
        fix_threading()  # inherited by the workers: read when torch loads there (or in the server they fork from)
        self.ctx = worker_context(hf=preload_hf)
        self.flags = Flags(self.ctx)
        self.workers = workers
        self._slots: dict[int, tuple[mp.process.BaseProcess, Connection]] = {}
        self._mu = threading.Lock()
        self._closed = False
        self._starting: threading.Thread | None = None
        env = dict(os.environ)
        if forked(self.ctx):  # each start waits for the server's imports: not this caller
            self._starting = threading.Thread(target=self._start_all, args=(preload_hf, env, True),
                                              name="hsbuild-standby", daemon=True)
            self._starting.start()
        else:
            self._start_all(preload_hf, env, False)

    def _start_all(self, preload_hf: bool, env: dict[str, str], forked: bool) -> None:
        try:
            for w in range(self.workers):
                mine, theirs = self.ctx.Pipe(duplex=True)
                p = self.ctx.Process(target=standby_main, args=(theirs, self.flags, preload_hf, env, w), daemon=True,
                                     name=f"hsbuild-worker-{w}")
                start_ignoring_stop_signals(p, forked)
                theirs.close()  # so a dead worker's pipe reads as EOF here
                with self._mu:
                    closed = self._closed
                    if not closed:
                        self._slots[w] = (p, mine)
                if closed:  # closed while this one started: not needed
                    _stop([(p, mine)])
                    return
        except BaseException:
            if not forked:
                self.close()
                raise
            # (on the thread: the slots started so far are taken or closed as usual; the coordinator starts
            # any worker missing here itself, and meets the same error there, in its own words)

    def _started(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None

    def pids(self) -> list[int]:
        """The standby workers' process ids, once they are started."""
        self._started()
        return [p.pid for p, _ in self._slots.values()]

    def take(self, w: int, settings) -> tuple[mp.process.BaseProcess, Connection] | None:
        """Worker `w`, given its settings: (its process, the coordinator's end of its pipe); None if there is no
        such standby worker or it is gone (the caller starts one)."""
        self._started()
        slot = self._slots.pop(w, None)
        if slot is None:
            return None
        p, conn = slot
        try:
            conn.send(settings)
        except OSError:  # it died while waiting (killed from outside): not this run's worker
            conn.close()
            p.join(timeout=1)
            return None
        return p, conn

    def close(self) -> None:
        """Stop every worker not taken. They hold nothing yet (no file, no sample), so they are killed at once
        rather than waited for: one may still be importing for seconds. Does not wait for the starts still
        under way (the fork server's imports): each one started after this is stopped as it comes."""
        with self._mu:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        _stop(slots)


def _stop(slots: list[tuple[mp.process.BaseProcess, Connection]]) -> None:
    for p, conn in slots:
        conn.close()
        if p.is_alive():
            p.kill()
    for p, _ in slots:
        p.join(timeout=5)
