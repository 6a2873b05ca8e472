"""tests/forked.py: a CLI process forked from the test zygote behaves as the exec'd one would, where a test can
tell: exit codes, signals, process groups, stdio, working directory, environment; an environment the zygote's
imports could not follow gets an exec'd process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import forked
import pytest

if not hasattr(os, "pidfd_open"):
    pytest.skip("no pidfd_open here (Linux < 5.3): every process is exec'd", allow_module_level=True)


def _run(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize(("code", "rc", "err"), [
    ("pass", 0, ""),
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit(None)", 0, ""),
    ("import sys; sys.exit('bye')", 1, "bye\n"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
])
def test_exit_codes_are_the_interpreters(code, rc, err):
    execd = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    for cp in (_run(code), execd):  # forked, then exec'd: the same
        assert cp.returncode == rc, cp
        assert (err in cp.stderr) if err else cp.stderr == "", cp


def test_stdio_cwd_env_argv_and_atexit(tmp_path):
    code = ("import atexit, os, sys\n"
            "atexit.register(lambda: print('atexit', flush=True))\n"
            "print(sys.stdin.read().upper(), os.getcwd(), os.environ['HSBUILD_STALL_S'], sys.argv[1:], __name__)\n"
            "sys.stdout.write('unflushed')\n")
    p = forked.Popen([sys.executable, "-c", code, "a", "b"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True, cwd=tmp_path, env={**os.environ, "HSBUILD_STALL_S": "7"})  # (read when a run starts)
    assert isinstance(p, forked.ForkedPopen)
    out, _ = p.communicate("in", timeout=60)
    assert p.returncode == 0 and out == f"IN {tmp_path} 7 ['a', 'b'] __main__\nunflushedatexit\n", out
    execd = subprocess.run([sys.executable, "-c", code, "a", "b"], input="in", capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "HSBUILD_STALL_S": "7"}, timeout=60)
    assert execd.stdout == out


def test_a_forked_child_is_its_own_process_group_with_start_new_session():
    p = forked.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert isinstance(p, forked.ForkedPopen)
    assert os.getpgid(p.pid) == p.pid and p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


def test_the_cli_runs_forked_and_an_import_time_variable_gets_an_exec():
    cmd = [sys.executable, "-m", "builder.cli", "--version"]
    forked_run = forked.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert isinstance(forked_run, forked.ForkedPopen)
    out, _ = forked_run.communicate(timeout=60)
    assert forked_run.returncode == 0 and out.strip()
    # HSBUILD_COMMIT_WAIT is read when builder.log.events is imported: the zygote read its own
    execd = forked.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "HSBUILD_COMMIT_WAIT": "7"})
    assert not isinstance(execd, forked.ForkedPopen)
    assert execd.communicate(timeout=60)[0] == out
