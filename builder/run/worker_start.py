"""How a run's local worker processes start: forked from a server that imported torch once, or spawned.

A worker needs torch, numpy, zarr and numcodecs: about 1.5 CPU-seconds of imports in a fresh interpreter. A run
that spawns N workers pays them N times, and a program that runs several builds (a notebook, a test suite, a
pipeline) pays them again for every run. So workers are forked from multiprocessing's fork server instead, which
imported those libraries once (builder/run/zygote.py) and stays up, idle, for the life of this process: a worker
then starts in a few milliseconds. The server imports nothing of hsbuild's that reads a setting, and never
touches a GPU (a forked child may initialize CUDA; a child of a process that did may not).

A forked child inherits the server's state, not this process's, so what a spawned worker would have had is
handed over explicitly, and the server is only used while it is the same:
- The environment: a worker takes this process's variables as they are when it starts (`child_setup`), so a
  setting changed since the server started (HSBUILD_*, a cache directory) reaches it as it would reach a
  spawned worker.
- The variables the preloaded libraries read once, when imported (threading: OMP_*, MKL_*, ...; IMPORT_TIME):
  when any differs from what the server started with, that server is let go and another one started, which
  imports them under the settings of now. A server started by other code in this process (its imports and
  environment unknown to us) is never used: workers are spawned.
- Stop signals: the server is started with SIGINT and SIGTERM ignored, which its children inherit, so a Ctrl-C
  or `kill -TERM -- -PGID` reaches the coordinator alone (as `start_ignoring_stop_signals` does for a spawned
  worker). Setting a signal's handler needs the main thread: from any other thread, workers are spawned.
- A run whose model is a Hugging Face directory asks for a server that also imported transformers' model
  classes (builder/run/zygote_hf.py: about 3 CPU-seconds, once, instead of in every worker). A server without
  them is let go for one with them; a server with them serves every later run (a superset). For such a server
  the variables transformers and huggingface_hub read at import (HF_IMPORT_TIME) are compared too.
- HSBUILD_WORKER_START=spawn spawns every worker (the behaviour before the server; for comparing the two).

A forked worker's parent is the server, which exits when this process does (the EOF of its liveness pipe, whose
other ends the workers close: `child_setup`); a worker dies with its parent (builder/run/worker.py), so none
outlives the coordinator either way.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from builder.run.prctl import set_process_name

START_ENV = "HSBUILD_WORKER_START"
ZYGOTE = "builder.run.zygote"
ZYGOTE_HF = "builder.run.zygote_hf"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Variables read by the preloaded libraries (or their OpenMP, MKL, BLAS and CUDA runtimes) when they are imported
IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO", "BLIS_", "NUMEXPR_", "TORCH", "PYTORCH",
               "CUDA", "NVIDIA_", "NPY_", "NUMPY_", "ZARR_", "NUMCODECS", "BLOSC", "LD_", "PYTHON")
# ... and by transformers, huggingface_hub, tokenizers and safetensors (a server that preloaded ZYGOTE_HF)
HF_IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "XDG_CACHE_HOME", "USE_TORCH",
                  "USE_TF", "USE_FLAX", "USE_JAX")
NAME_PREFIX = "hsbuild-w"  # a worker's process name (ps, top, /proc/PID/comm): hsbuild-w0, hsbuild-w1, ...


@dataclass(frozen=True)
class _Server:
    """The fork server this module started: its pid, whether it preloaded ZYGOTE_HF, and the import-time
    variables it started under."""

    pid: int
    hf: bool
    env: dict[str, str]


_lock = threading.Lock()
_server: _Server | None = None


def import_time_env(env: dict[str, str] | os._Environ | None = None, hf: bool = False) -> dict[str, str]:
    """The variables of `env` (default: this process's) that the preloaded libraries read when imported (with
    `hf`: transformers' too)."""
    src = os.environ if env is None else env
    prefixes = IMPORT_TIME + HF_IMPORT_TIME if hf else IMPORT_TIME
    return {k: v for k, v in src.items() if k.startswith(prefixes)}


def worker_context(hf: bool = False) -> mp.context.BaseContext:
    """The context to start this run's workers from: the fork server with the libraries preloaded (with `hf`,
    transformers' model classes too), started now if it is not running (it imports them while the caller goes
    on), or `spawn` where that server would not give a worker what a fresh interpreter would (the module's
    docstring)."""
    spawn = mp.get_context("spawn")
    if os.environ.get(START_ENV, "") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return spawn
    if threading.current_thread() is not threading.main_thread():
        return spawn
    global _server
    fs = getattr(mp_forkserver, "_forkserver", None)
    if fs is None or not all(hasattr(fs, a) for a in ("_forkserver_pid", "_forkserver_alive_fd")):
        return spawn  # another Python's multiprocessing: not ours to drive (child_setup needs both)
    with _lock:
        pid = fs._forkserver_pid
        if pid is not None and (_server is None or _server.pid != pid):
            return spawn  # started by other code in this process
        if pid is not None and (_server.env != import_time_env(hf=_server.hf) or (hf and not _server.hf)):
            _retire(fs)  # its imports saw other settings, or lack ones this run needs: a new one, for this run and
            pid = None  # those after it
        hf = hf or (pid is not None and _server.hf)  # (what a server that ensure_running restarts preloads)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([ZYGOTE, ZYGOTE_HF] if hf else [ZYGOTE])
        with stop_signals_ignored():  # (inherited by the server, and by its children from it)
            mp_forkserver.ensure_running()  # (re)starts it if it is not up: spawns it, does not wait for its imports
        if _server is None or _server.pid != fs._forkserver_pid:
            _server = _Server(fs._forkserver_pid, hf, import_time_env(hf=hf))
        return ctx


def _retire(fs) -> None:
    """Let the server go: this process's end of its liveness pipe closed, it exits once every worker forked from
    it has (those of past runs are gone; `child_setup` closed theirs); reaped on a thread. The next
    `ensure_running` starts another."""
    with fs._lock:
        pid, fd = fs._forkserver_pid, fs._forkserver_alive_fd
        fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
    if fd is not None:
        os.close(fd)
    if pid is not None:
        threading.Thread(target=_reap, args=(pid,), name="hsbuild-forkserver-reaper", daemon=True).start()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


@contextlib.contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored by this process while a process is started (an ignored signal stays ignored
    across fork and exec), their handlers given back after. Main thread only."""
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def running_server() -> int | None:
    """The pid of the fork server this module started, while it runs; None otherwise."""
    fs = getattr(mp_forkserver, "_forkserver", None)
    with _lock:
        if _server is None or fs is None or getattr(fs, "_forkserver_pid", None) != _server.pid:
            return None
    try:
        os.kill(_server.pid, 0)
    except OSError:
        return None
    return _server.pid


def forked(ctx: mp.context.BaseContext) -> bool:
    """Whether `ctx` forks its processes from the server (starting one is then quick and needs no signal
    handling in this thread)."""
    return ctx.get_start_method() == "forkserver"


def child_setup(env: dict[str, str], worker: int) -> None:  # pragma: no cover - in the worker process
    """First thing in a worker: stop signals ignored (already so, from the spawn or the server; kept so), the
    server's liveness pipe closed (below), the coordinator's environment as it was at the start, and the process
    named `hsbuild-wN`.

    multiprocessing hands every forked child the write end of the pipe whose EOF tells the server that its
    clients are gone, so that a child may start processes of its own. A worker starts none; were it to keep that
    end, the server would outlive a SIGKILLed coordinator as long as any worker lived, and a worker that does not
    read its pipe (one busy with a sample) would outlive both: its parent-death signal comes from the server.

    A worker's own multiprocessing locks (numcodecs' Blosc mutex, made at its first encode; tqdm's) are for its
    threads alone: its default start method is set to `fork`, so they are anonymous semaphores, unlinked as they
    are made. Under the server's (or spawn's) start method they were named ones, registered with the
    coordinator's resource tracker: a worker killed with its coordinator (kill -9) left them for that tracker to
    unlink, which said "There appear to be N leaked semaphore objects" on the run's stderr."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    mp.set_start_method("fork", force=True)  # (a worker starts no process: this only makes its locks anonymous)
    if server_pid() is not None:
        fs = mp_forkserver._forkserver
        if fs._forkserver_alive_fd is not None:
            os.close(fs._forkserver_alive_fd)
            fs._forkserver_alive_fd = None
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
    set_process_name(f"{NAME_PREFIX}{worker}")


def server_pid() -> int | None:
    """In a worker: the pid of the server it was forked from (its expected parent); None if it was spawned."""
    zygote = sys.modules.get(ZYGOTE)
    pid = getattr(zygote, "SERVER_PID", None)
    return pid if pid is not None and pid != os.getpid() else None
