"""Workers spawned before the coordinator needs them (builder/run/standby.py) never outlive it: not when the run
has nothing to do, not when the coordinator is SIGKILLed while they wait, and a taken one runs the samples."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

from builder.run.coordinator import RunOptions, run_build
from builder.run.standby import Standby


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # a zombie waiting for init to reap it: nothing of it runs


def test_a_run_with_nothing_to_do_leaves_no_worker_behind(make_build):
    build = make_build(3)
    first = run_build(build, RunOptions(workers=2), echo=lambda m: None)
    assert first.written == 3
    assert not mp.active_children()
    given = Standby(2)  # as the CLI passes them
    pids = [p.pid for p, _ in given._slots.values()]
    again = run_build(build, RunOptions(workers=2, standby=given), resume=True, echo=lambda m: None)
    assert again.written == 0 and again.exit_code == 0
    assert not mp.active_children() and all(_gone(p) for p in pids)


def test_standby_workers_exit_when_their_coordinator_is_sigkilled(tmp_path):
    script = ("import os, signal, sys, time\n"
              "from builder.run.standby import Standby\n"
              "s = Standby(2)\n"
              "print(' '.join(str(p.pid) for p, _ in s._slots.values()), flush=True)\n"
              "time.sleep(float(sys.argv[1]))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    for wait in (0.1, 6.0):  # killed while its workers import torch, and once they wait for their settings
        p = subprocess.run([sys.executable, "-c", script, str(wait)], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
        assert p.returncode == -9, p.stderr
        pids = [int(x) for x in p.stdout.split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), f"standby workers {pids} outlived their coordinator"
