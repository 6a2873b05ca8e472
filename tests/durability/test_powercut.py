"""Power cuts: what hsbuild acknowledged must survive a cut, under POSIX's worst case (--dirs strict) and as ext4/xfs
behave (--dirs journal).

Each test runs hsbuild (or the EventLog) as a subprocess on a lazyfs mount (../shared/powercut), cuts the power,
remounts and checks the build. Before the fixes, strict mode lost a freshly created build whole and rolled the
log back to `init` (the WAL's directory entry was never fsynced).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import hsbuild
from powercut_fixture import fsync_dir

from builder.extract.demo import write_demo_source

RUN_ARGS = ["--no-progress", "--low", "0.999", "--high", "0.999", "--flood", "0.9999"]


def hs(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """A command that only reads (status, sql, verify: in this process, tests/cli_runner.py); the runs that the
    power cut hits are real processes (`fs.run`, `fs.popen`)."""
    return hsbuild(*args, cwd=cwd, timeout=timeout)


# The run that the power cut hits is held by the test hook: its WORKERS each stop at task HELD_AT (HELD_GROUP
# samples made durable together), so at least HELD_AT - HELD_GROUP >= 30 samples are acknowledged before the
# hold, and it is certainly still going at the cut. N: more than the WORKERS * (HELD_AT - 1) it can write.
WORKERS, HELD_AT, HELD_GROUP = 2, 35, 5
N = WORKERS * (HELD_AT - 1) + 12


def _source(tmp_path, n=N):
    return write_demo_source(tmp_path / "src.jsonl", n=n)  # outside the mount


def _written(fs, build="B") -> int:
    """Written events the live owner reports (through its socket); -1 while it cannot answer."""
    r = hs("sql", "--json", fs.path(build), "SELECT count(*) AS n FROM events WHERE kind = 'written'", timeout=60)
    try:
        return int(json.loads(r.stdout)[0]["n"]) if r.returncode == 0 else -1
    except (ValueError, KeyError, IndexError, TypeError):
        return -1


def test_init_is_durable(powercut, tmp_path):
    fs = powercut("strict")
    r = fs.run(["init", "B", "--source", _source(tmp_path)])
    assert r.returncode == 0, r.stderr
    rep = fs.crash()
    fs.remount()
    st = hs("status", fs.path("B"))
    assert st.returncode == 0, f"vanished: {rep['vanished']}\n{st.stderr}"


EVENTLOG_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from builder.log.events import Event, EventLog
    path, acked = Path(sys.argv[1]), 0
    for cycle in range(4):          # open / append / close, as init, run and verify do; the last stays open
        log = EventLog(path)
        for _ in range(3):
            log.append([Event("gc", detail=str(acked))]); acked += 1
        print(acked, flush=True)
        if cycle < 3:
            log.close()
    print("READY", flush=True)
    time.sleep(600)
""")


def test_eventlog_commits_survive_power_cut(powercut):
    fs = powercut("strict")
    fs.path("B").mkdir()
    fsync_dir(fs.mnt)  # the directory itself is durable: only the log's own discipline is under test
    p = fs.popen([fs.path("B", "events.duckdb")], program=[sys.executable, "-c", EVENTLOG_CHILD])
    lines = []
    for line in p.stdout:
        if line.startswith("READY"):
            break
        lines.append(line)
    acked = int(lines[-1])
    fs.crash()
    fs.remount()
    check = subprocess.run([sys.executable, "-c", (
        "import sys; from pathlib import Path; from builder.log.events import EventLog\n"
        "with EventLog(Path(sys.argv[1]), read_only=True) as log:\n"
        "    print(log.query(\"SELECT count(*) FROM events WHERE kind = 'gc'\")[1][0][0])"),
        fs.path("B", "events.duckdb")], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, f"the log does not open after the cut: {check.stderr[-600:]}"
    assert int(check.stdout) == acked


@pytest.mark.slow
@pytest.mark.parametrize("dirs", ["strict", "journal"])
def test_power_cut_mid_run_keeps_acknowledged_writes(powercut, tmp_path, dirs, hold):
    """A cut at a random moment of a run: every sample the surviving log calls written verifies, nothing it
    acknowledged is lost, and resume finishes with each sample exactly once."""
    fs = powercut(dirs)
    assert fs.run(["init", "B", "--source", _source(tmp_path)]).returncode == 0
    held = hold(HELD_AT)  # never let go: the cut kills the run, held or not yet
    p = fs.popen(["run", "B", *RUN_ARGS, "--workers", str(WORKERS)],
                 env={"HSBUILD_TEST_HOLD": held.spec, "HSBUILD_GROUP_SAMPLES": str(HELD_GROUP)})
    target = random.randint(3, 30)
    acked, deadline = -1, time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline and acked < target:
        acked = _written(fs)
        time.sleep(0.3)
    assert p.poll() is None and acked >= target, f"run ended or stalled before the cut (acked={acked})"
    time.sleep(random.uniform(0, 1.0))
    assert p.poll() is None
    fs.crash()
    fs.remount()
    st = hs("sql", "--json", fs.path("B"), "SELECT count(*) AS n FROM events WHERE kind = 'written'")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)[0]["n"] >= acked, f"acknowledged {acked} written events before the cut"
    v = hs("verify", fs.path("B"))
    assert v.returncode == 0, v.stdout + v.stderr
    r = fs.run(["resume", "B", *RUN_ARGS])
    assert r.returncode == 0, r.stdout + r.stderr
    once = hs("sql", "--json", fs.path("B"), "SELECT sample_id, count(*) AS n FROM events WHERE kind = 'written' "
                                            "GROUP BY 1 HAVING count(*) > 1")
    assert once.returncode == 0 and json.loads(once.stdout) == [], once.stdout
    done = hs("sql", "--json", fs.path("B"), "SELECT count(*) AS n FROM samples WHERE state IN ('written', 'verified')")
    assert json.loads(done.stdout)[0]["n"] == N
    assert hs("verify", fs.path("B")).returncode == 0
