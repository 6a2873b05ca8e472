"""The CLI for tests: `hsbuild(...)` runs `builder.cli.app.main(argv)` in this process, as a fresh
`python -m builder.cli` process would run it; `hsbuild_proc(...)` runs that real process.

Both return a `subprocess.CompletedProcess` (args, returncode, stdout, stderr: text, newlines translated as
`subprocess.run(..., text=True)` does) and take the same keywords: `check` (raise on a non-zero exit),
`timeout`, `cwd`, `env` (the whole environment, as for subprocess), `input` (stdin's text).

In this process a call saves what a real one pays first: a Python start and the imports (torch's: seconds of
CPU on a loaded CI core). What a real process would have, one call gets too:
- stdout and stderr captured at the file-descriptor level (what the CLI's child processes, e.g. a run's
  spawned workers, and C code write is captured, not only `print`), neither a terminal;
- SystemExit turned into the exit code as the interpreter does (argparse's errors: 2), an uncaught exception
  into its traceback on stderr and exit code 1;
- sys.argv, the working directory (`cwd`), the environment (`env`) and stdin (`input`) set for the call and
  given back after it, and so are every signal handler (a run takes SIGINT and SIGTERM);
- at the end, as at a process's exit: its non-daemon threads joined, its daemonic multiprocessing children
  terminated, a Ray driver it connected (`--ray`) disconnected, and the garbage collected when it left files
  open (an unreachable DuckDB connection or lock file must not stay open in the test's process, where a later
  real process would find it busy);
- `timeout`: past it the call gets a SIGINT (a run stops at a safe point) and TimeoutExpired is raised.

What only a real process can give, a test asks for with `hsbuild_proc` / the `cli_proc` fixture (or Popen):
signals from outside and kill -9, exit codes from the interpreter itself, two owners of a build at once (a flock
and DuckDB's file lock are per process), environment variables read when a module is imported. Calls are routed
to the real process anyway where the in-process run could not be the same:
- an environment (the `env` given, else this process's: e.g. monkeypatch.setenv) that differs from the one
  the test started with (`note_environment`, an autouse fixture) in a variable outside CALL_TIME_ENV: one read
  at import (HF_ENDPOINT by huggingface_hub, HSBUILD_COMMIT_WAIT by builder.log.events, ...) or unknown here
  (variables libraries set in this process as they are imported, SET_BY_LIBRARIES, are not the test's);
- keywords other than the ones above;
- HSBUILD_TEST_CLI=process in the environment: every call a real process (to compare, or to debug).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import thread as _futures_thread
from pathlib import Path

import builder.cli

# Variables the CLI (or the processes it spawns, which start fresh) reads when a command runs, not when a module
# is imported: an environment that changes only these can run in this process.
CALL_TIME_ENV = {"HSBUILD_GROUP_SAMPLES", "HSBUILD_GROUP_SECONDS", "HSBUILD_COMMITS_IN_FLIGHT",
                 "HSBUILD_COMMIT_OVERLAP", "HSBUILD_STALL_S", "HSBUILD_STOP_GRACE", "HSBUILD_SERVER_TIMEOUT",
                 "HSBUILD_CACHE_DIR", "HSBUILD_TEST_HOLD", "PYTHONUNBUFFERED",
                 "HSBUILD_FORMATS"}  # (the format registry reads it at every lookup)
# set in this process by libraries as they are imported or work (vllm's env_override, torch's inductor, hsbuild's
# own setdefault for huggingface_hub): a real process started now inherits them too; not a test's change
SET_BY_LIBRARIES = {"LD_LIBRARY_PATH", "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK",
                    "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONBREAKPOINT"}  # (Ray's driver)
SET_BY_LIBRARIES_PREFIXES = ("TORCHINDUCTOR_", "TRITON_", "TILELANG_", "AITER_")
KNOWN_KW = {"cwd", "env", "input"}
MAIN_PATH = str(Path(builder.cli.__file__).with_name("__main__.py"))  # sys.argv[0] of `python -m builder.cli`
WATCHDOG = "hsbuild-test-timeout"  # the thread that sends a call its SIGINT at its timeout
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


_ENV_AT_START: dict[str, str] | None = None


def note_environment() -> None:
    """The environment as a test starts (conftest: once it set its own defaults, and at each test's setup,
    before the test's fixtures change it): a call whose environment differs from it outside CALL_TIME_ENV gets
    a real process."""
    global _ENV_AT_START  # noqa: PLW0603
    _ENV_AT_START = dict(os.environ)


def _raise_if(check: bool, cp: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if check and cp.returncode != 0:
        raise AssertionError(f"hsbuild {cp.args[3:]} exited {cp.returncode}\nstdout:{cp.stdout}\nstderr:{cp.stderr}")
    return cp


def hsbuild_proc(*args, check: bool = False, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (`python -m builder.cli ARGS`; forked from the test zygote where it can
    be: tests/forked.py)."""
    import forked  # noqa: PLC0415 - (it imports this module)

    env = {**(kw.pop("env", None) or os.environ), "PYTHONUNBUFFERED": "1"}
    cp = forked.run([sys.executable, "-m", "builder.cli", *map(str, args)], capture_output=True, text=True,
                    timeout=timeout, env=env, **kw)
    return _raise_if(check, cp)


def _routed_to_process(kw: dict) -> str | None:
    """Why this call needs a real process, or None."""
    if os.environ.get("HSBUILD_TEST_CLI") == "process":
        return "HSBUILD_TEST_CLI=process"
    if set(kw) - KNOWN_KW:
        return f"keywords {sorted(set(kw) - KNOWN_KW)}"
    env = kw.get("env")
    at_import = import_time_changes(os.environ if env is None else env,
                                    _ENV_AT_START if _ENV_AT_START is not None else os.environ)
    if at_import:
        return f"environment changes {sorted(at_import)}"
    return None


def import_time_changes(env, start) -> set[str]:  # noqa: ANN001 - mappings of str
    """The variables that differ between the environments `env` and `start` and may be read when a module is
    imported: neither CALL_TIME_ENV nor set by libraries (nor pytest's own)."""
    changed = {k for k in set(env) | set(start) if env.get(k) != start.get(k) and not k.startswith("PYTEST_")}
    return {k for k in changed - CALL_TIME_ENV - SET_BY_LIBRARIES if not k.startswith(SET_BY_LIBRARIES_PREFIXES)}


def hsbuild(*args, check: bool = False, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run the CLI's `main(argv)` in this process, as `python -m builder.cli ARGS` would (module docstring);
    a call that needs a real process gets one."""
    why = _routed_to_process(kw)
    if why:
        _log(f"{args[:1]} as a real process: {why}")
        return hsbuild_proc(*args, check=check, timeout=timeout, **kw)
    return _raise_if(check, run_in_process([str(a) for a in args], timeout=timeout, **kw))


def _log(msg: str) -> None:
    """HSBUILD_TEST_CLI_LOG=FILE: which calls got a real process and why, and what in-process calls left open."""
    path = os.environ.get("HSBUILD_TEST_CLI_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}: {msg}\n")


def _text(raw: bytes) -> str:
    # as subprocess.run(text=True) decodes: the locale's encoding (UTF-8 here), universal newlines
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _exit_code(code: object) -> int:
    """The exit status of a process that ended with sys.exit(code) (a non-int is printed to stderr: 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _open_fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return set()


def _fd_targets(fds: set[str]) -> dict[str, str]:
    out = {}
    for fd in fds:
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def _is_pool_thread(t: threading.Thread) -> bool:
    # a ThreadPoolExecutor's worker: idle ones do not hold up a process's exit (concurrent.futures stops them)
    return getattr(t, "_target", None) is _futures_thread._worker  # noqa: SLF001


@contextlib.contextmanager
def _sigint_after(timeout: float | None):
    """Yields a list that holds True once `timeout` passed; then the main thread got one SIGINT (a real one,
    so a blocking call returns to run the handler: a run stops at a safe point, else KeyboardInterrupt)."""
    fired: list[bool] = []
    if timeout is None:
        yield fired
        return
    done = threading.Event()
    main_id = threading.main_thread().ident

    def watch() -> None:
        if not done.wait(timeout):
            fired.append(True)
            signal.pthread_kill(main_id, signal.SIGINT)

    t = threading.Thread(target=watch, name=WATCHDOG, daemon=True)
    t.start()
    try:
        yield fired
    finally:
        done.set()
        t.join()


def run_in_process(argv: list[str], timeout: float | None = 300, cwd=None, env: dict | None = None,
                   input: str | None = None) -> subprocess.CompletedProcess:  # noqa: A002 - subprocess's name
    from builder.cli.app import main  # noqa: PLC0415

    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("hsbuild() in-process runs on the main thread only (signals); use hsbuild_proc")
    cmd = [sys.executable, "-m", "builder.cli", *argv]
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    threads_before = set(threading.enumerate())
    ray_before = _ray_connected()
    children_before = set(_mp_children())
    fds_before = _open_fds()
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    saved_env = dict(os.environ) if env is not None else None
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    saved_fds = os.dup(1), os.dup(2)
    rc, fired = 1, []
    try:
        os.dup2(out_f.fileno(), 1)
        os.dup2(err_f.fileno(), 2)
        # like PYTHONUNBUFFERED=1: every write reaches the file at once, in order with the children's
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)
        if input is not None:
            sys.stdin = io.StringIO(input)
        sys.argv = [MAIN_PATH, *argv]
        if saved_env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with _sigint_after(timeout) as fired:
            try:
                rc = _exit_code(main(argv))
            except SystemExit as e:
                rc = _exit_code(e.code)
            except Exception:  # noqa: BLE001 - as the interpreter: the traceback on stderr, exit code 1
                traceback.print_exc()
                rc = 1
            _end_like_a_process(threads_before, children_before, ray_before, deadline=time.monotonic() + 30)
    finally:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        sys.argv = saved_argv
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(saved_cwd)
        if saved_env is not None:
            os.environ.clear()
            os.environ.update(saved_env)
        for s, h in handlers.items():
            if h is not None and signal.getsignal(s) is not h:
                signal.signal(s, h)
        out_f.seek(0)
        err_f.seek(0)
        stdout, stderr = _text(out_f.read()), _text(err_f.read())
        out_f.close()
        err_f.close()
    _close_what_it_left(fds_before)
    if fired:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, rc, stdout, stderr)


def _mp_children():
    import multiprocessing  # noqa: PLC0415

    return multiprocessing.active_children()


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _end_like_a_process(threads_before: set, children_before: set, ray_before: bool, deadline: float) -> None:
    """What a process's exit does to what the command left: a Ray driver it connected disconnected, non-daemon
    threads joined (bounded here), daemonic multiprocessing children terminated and the others joined."""
    if _ray_connected() and not ray_before:
        sys.modules["ray"].shutdown()
    for t in set(threading.enumerate()) - threads_before:
        if not t.daemon and not _is_pool_thread(t) and t.name != WATCHDOG:
            t.join(max(0.0, deadline - time.monotonic()))
    for p in set(_mp_children()) - children_before:
        if p.daemon:
            p.terminate()
        p.join(max(0.0, deadline - time.monotonic()))
    if os.environ.get("HSBUILD_TEST_CLI_LOG"):
        left = [t.name for t in set(threading.enumerate()) - threads_before
                if t.is_alive() and not _is_pool_thread(t) and t.name != WATCHDOG]
        if left:
            _log(f"threads left running: {sorted(left)}")


def _close_what_it_left(fds_before: set[str]) -> None:
    """Files the command left open are closed as its exit would close them: the garbage is collected (an
    unreachable connection, lock or file object closes its descriptor). What stays open after that (files, not
    the pipes and sockets of pools and trackers) goes to HSBUILD_TEST_CLI_LOG."""
    if not _open_fds() - fds_before:
        return
    gc.collect()
    if os.environ.get("HSBUILD_TEST_CLI_LOG"):
        still = {fd: t for fd, t in _fd_targets(_open_fds() - fds_before).items() if t.startswith("/")
                 and not t.startswith("/dev/")}
        if still:
            _log(f"left open: {still}")
