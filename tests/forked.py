"""Real processes for the CLI, forked from a zygote that imported hsbuild and its libraries once.

`Popen(cmd, **kw)` and `run(cmd, **kw)` are drop-ins for subprocess's. For `[sys.executable, "-m", "builder.cli",
ARGS...]` or `[sys.executable, "-c", CODE, ARGS...]` the process is forked from this test process's zygote (a
`python -c` started once, single-threaded, that imported builder.cli and duckdb, numpy, pyarrow, zarr, numcodecs
and torch) instead of exec'd: it starts in milliseconds instead of paying ~0.6-1.5 CPU-s of imports. Any other
command, keyword or environment gets a plain subprocess.

What a test relies on from a real process, the forked one has: its own pid (signals, kill -9, `os.killpg` with
`start_new_session`), its exit code (as the interpreter sets it: SystemExit, an uncaught exception's 1, -N for a
signal), stdin/stdout/stderr as given (pipes, files, DEVNULL; Popen's communicate, text mode and timeouts are
subprocess's own), its working directory and environment, `__main__` as `python -m` / `python -c` make it, and
the interpreter's exit up to its module teardown (non-daemon threads joined, atexit handlers run, the streams
flushed; then `os._exit`: tearing down torch's modules costs about a CPU-second, and a program's outcome never
rests on it). Its parent is the zygote, which reaps it and passes its exit status on (a pidfd per child), so
`wait`, `poll` and `returncode` read that. Unlike a fresh interpreter it has the zygote's modules imported: a test
of what a command imports (e.g. that the coordinator never imports torch) runs a plain subprocess.

Where the fork could differ from an exec, an exec it is:
- an environment whose variables read at import (anything outside cli_runner's CALL_TIME_ENV, or set by
  libraries) differ from the zygote's: the zygote's modules read theirs when it started;
- `preexec_fn`, `pass_fds`, `close_fds=False`, `shell`, a non-list command, or other unusual keywords;
- no `os.pidfd_open` (Linux < 5.3: the zygote exits at once), a zygote that died, or HSBUILD_TEST_FORK=0 in the
  environment (to compare, or to debug).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import threading

import cli_runner

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT
CompletedProcess, TimeoutExpired = subprocess.CompletedProcess, subprocess.TimeoutExpired
FORKABLE_KW = {"stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors", "env", "cwd",
               "start_new_session", "bufsize"}

# The zygote: serves fork requests on the socket whose fd is argv[1]; each request brings the child's stdin,
# stdout, stderr and a status socket (SCM_RIGHTS), on which the child writes `pid N` once it is set up, and the
# zygote `exit CODE` once it has reaped it.
ZYGOTE = r"""
import atexit, io, json, os, runpy, selectors, signal, socket, sys, threading, types
ctl = socket.socket(fileno=int(sys.argv[1]))
os.close(os.pidfd_open(os.getpid()))  # (a kernel without pidfds, < 5.3: this raises, the zygote is gone, all exec)
import builder.cli.app, builder.run.coordinator, duckdb, numcodecs, numpy, pyarrow, torch, zarr  # noqa

def serve():
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    children = {}  # pidfd -> (pid, status socket)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not ctl:
                pid, status = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                try:
                    status.sendall(f"exit {code}\n".encode())
                except OSError:
                    pass
                status.close()
                continue
            msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 4)
            if not msg:
                os._exit(0)  # the test process is gone
            status = socket.socket(fileno=fds[3])
            pid = os.fork()
            if pid == 0:
                sel.close()
                for _, s in children.values():
                    s.detach()
                for fd in children:
                    os.close(fd)
                os.close(ctl.detach())
                return json.loads(msg), fds[:3], status
            for fd in fds[:3]:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = (pid, status)
            sel.register(pidfd, selectors.EVENT_READ)

req, stdio, status = serve()
for i, fd in enumerate(stdio):
    os.dup2(fd, i)
    os.close(fd)
if req["cwd"] is not None:
    os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(req["env"])
if req["new_session"]:
    os.setsid()
status.sendall(f"pid {os.getpid()}\n".encode())  # (set up: as a Popen returns once its child is exec'd)
os.close(status.detach())
unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
kept = (sys.stdin, sys.stdout, sys.stderr)  # (the zygote's, on fds 0-2: closed at exit)
sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding=kept[0].encoding)
for n, fd in (("stdout", 1), ("stderr", 2)):
    raw = io.open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    stream = io.TextIOWrapper(raw, encoding=kept[fd].encoding, errors=kept[fd].errors, write_through=unbuffered,
                              line_buffering=not unbuffered and (fd == 2 or raw.isatty()))
    setattr(sys, n, stream)
    setattr(sys, f"__{n}__", stream)
code = 0
try:
    if req["module"]:
        sys.argv = ["-m", *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *req["args"]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
except SystemExit as e:  # as the interpreter turns it into an exit status
    code = 0 if e.code is None else e.code & 0xFF if isinstance(e.code, int) else 1
    if not isinstance(e.code, int | None):
        print(e.code, file=sys.stderr)
except BaseException as e:
    sys.excepthook(type(e), e, e.__traceback__)
    code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
# the interpreter's exit up to its module teardown (which, with torch loaded, costs about a CPU-second): non-daemon
# threads joined, atexit handlers run, the standard streams flushed
threading._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except (OSError, ValueError):
        pass
if code < 0:  # killed by the signal, as an uncaught KeyboardInterrupt ends the interpreter
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""

_lock = threading.Lock()
_zygote: tuple[subprocess.Popen, socket.socket, dict[str, str]] | None = None


def _start(env: dict[str, str]) -> tuple[subprocess.Popen, socket.socket, dict[str, str]]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                            stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL, env=env)
    theirs.close()
    atexit.register(mine.close)  # (its EOF ends the zygote; the children it forked go on as they would)
    return proc, mine, env


def _request(cmd, kw: dict) -> dict | None:
    """The zygote's request for `cmd`, or None when it must be exec'd."""
    if os.environ.get("HSBUILD_TEST_FORK") == "0" or not hasattr(os, "pidfd_open") or not isinstance(cmd, list):
        return None
    if set(kw) - FORKABLE_KW or len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    base = {"env": env, "cwd": None if kw.get("cwd") is None else str(kw["cwd"]),
            "new_session": bool(kw.get("start_new_session"))}
    if cmd[1] == "-m" and len(cmd) >= 3 and cmd[2] == "builder.cli":
        return {**base, "module": "builder.cli", "args": [str(a) for a in cmd[3:]]}
    if cmd[1] == "-c" and len(cmd) >= 3:
        return {**base, "module": None, "code": cmd[2], "args": [str(a) for a in cmd[3:]]}
    return None


def _zygote_for(env: dict[str, str]) -> socket.socket | None:
    """The zygote's socket, if it can fork a process with `env` (started now, under the environment the current
    test started with: cli_runner.note_environment)."""
    global _zygote  # noqa: PLW0603
    with _lock:
        if _zygote is None:
            _zygote = _start(dict(cli_runner._ENV_AT_START or os.environ))  # noqa: SLF001
        proc, ctl, started = _zygote
    if proc.poll() is not None:  # it failed (never started again: every process is exec'd)
        return None
    return None if cli_runner.import_time_changes(env, started) else ctl


class ForkedPopen(subprocess.Popen):
    """A Popen whose child is forked from the zygote (module docstring)."""

    def __init__(self, cmd, request: dict, ctl: socket.socket, **kw):
        self._request, self._ctl, self._buf = request, ctl, b""
        super().__init__(cmd, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        mine, theirs = socket.socketpair()
        try:
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2, theirs.fileno()]
            socket.send_fds(self._ctl, [json.dumps(self._request).encode()], fds)
        finally:
            theirs.close()
        self._status = mine
        line = self._line(None) or ""
        if not line.startswith("pid "):
            raise OSError(f"the test zygote did not start the process ({line or 'it is gone'})")
        self.pid = int(line.split()[1])
        self._child_created = True
        # (as subprocess does in the parent: the child's ends of the pipes it made)
        if p2cread != -1 and p2cwrite != -1 and p2cread != getattr(self, "_devnull", None):
            os.close(p2cread)
        if c2pwrite != -1 and c2pread != -1 and c2pwrite != getattr(self, "_devnull", None):
            os.close(c2pwrite)
        if errwrite != -1 and errread != -1 and errwrite != getattr(self, "_devnull", None):
            os.close(errwrite)
        if hasattr(self, "_devnull"):
            os.close(self._devnull)
        self._closed_child_pipe_fds = True

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the zygote about this child; None at EOF or when none came within `timeout`."""
        while b"\n" not in self._buf:
            if timeout is not None and not select.select([self._status], [], [], timeout)[0]:
                return None
            chunk = self._status.recv(64)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._status.close()
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if timeout is not None:
                    raise TimeoutExpired(self.args, timeout)
                raise OSError("the test zygote died before its child")
            self.returncode = int(line.split()[1])
            self._status.close()
        return self.returncode


def Popen(cmd, **kw) -> subprocess.Popen:  # noqa: N802 - subprocess.Popen's drop-in
    """subprocess.Popen(cmd, **kw); a CLI command forked from the zygote where it can be (module docstring)."""
    request = _request(cmd, kw)
    ctl = _zygote_for(request["env"]) if request is not None else None
    if ctl is not None:
        try:
            return ForkedPopen(cmd, request, ctl, **kw)
        except OSError:  # the zygote is gone (no pidfds, a failed import): an exec'd process says what is wrong, if any
            pass
    return subprocess.Popen(cmd, **kw)


def run(cmd, *, input=None, capture_output=False, timeout=None, check=False, **kw) -> CompletedProcess:  # noqa: A002
    """subprocess.run's drop-in over this module's Popen."""
    if input is not None:
        kw["stdin"] = PIPE
    if capture_output:
        kw["stdout"] = kw["stderr"] = PIPE
    with Popen(cmd, **kw) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except TimeoutExpired:
            p.kill()
            p.wait()
            raise
        except BaseException:
            p.kill()
            raise
        code = p.poll()
    cp = CompletedProcess(p.args, code, out, err)
    if check:
        cp.check_returncode()
    return cp
