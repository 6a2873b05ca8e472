"""Workers spawned before the coordinator needs them (builder/run/standby.py) never outlive it: not when the run
has nothing to do, not when the coordinator is SIGKILLed while they wait, and a taken one runs the samples."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import process_group, worker_pids

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
    pids = given.pids()
    again = run_build(build, RunOptions(workers=2, standby=given), resume=True, echo=lambda m: None)
    assert again.written == 0 and again.exit_code == 0
    assert not mp.active_children() and all(_gone(p) for p in pids)


def test_standby_workers_exit_when_their_coordinator_is_sigkilled(tmp_path):
    """Nothing the standby started (its workers, the fork server they fork from) outlives a SIGKILLed
    coordinator, wherever it was: the server still importing torch, the workers importing extraction's code, the
    workers waiting for their settings."""
    script = ("import os, signal, sys, time\n"
              "from builder.run.standby import Standby\n"
              "s = Standby(2)\n"
              "print(os.getpid(), flush=True)\n"
              "if sys.argv[2] == 'started':\n"
              "    print(' '.join(str(p) for p in s.pids()), flush=True)\n"
              "time.sleep(float(sys.argv[1]))\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    for wait, when in ((0.1, "now"), (0.1, "started"), (6.0, "started")):
        p = subprocess.run([sys.executable, "-c", script, str(wait), when], capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).resolve().parents[2], start_new_session=True)
        assert p.returncode == -9, p.stderr
        group, *rest = p.stdout.splitlines()
        pids = [int(x) for x in rest[0].split()] if rest else []
        assert len(pids) == (2 if when == "started" else 0)
        deadline = time.monotonic() + 30
        while process_group(int(group)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_group(int(group)), f"{process_group(int(group))} outlived their coordinator ({wait} s, {when})"
        assert all(_gone(pid) for pid in pids), f"standby workers {pids} outlived their coordinator"


def test_a_standby_closed_while_its_workers_start_stops_each_as_it_comes():
    """close() does not wait for the fork server's imports (a refused run exits at once); the workers started
    after it are stopped as they come, and none is left."""
    given = Standby(2)
    given.close()
    given._started()  # (the test waits for the starts under way; close did not)
    deadline = time.monotonic() + 10
    while (worker_pids(os.getpid()) or mp.active_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker_pids(os.getpid()) and not mp.active_children()
