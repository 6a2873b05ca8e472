"""Ctrl-C during a storage stall (issue 30): the run says at once what the stop waits for (the stalled write, on
which filesystem), stops at a safe point once the volume answers again (exit 130), and nothing committed is lost;
a second Ctrl-C says that the exit waits for the stalled write, and exits 130 once it returns.

Deterministic: the run's one worker is held by the test hook (builder/run/testhook.py) before its 6th task, the
volume is stalled, and only then is the worker let go: its next write certainly hangs, mid-run."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from conftest import Hold, Watched, hsbuild

from builder.extract.demo import write_demo_source
from builder.layout import layout
from builder.log.lock import parse_record

RUN_ARGS = ["--no-progress", "--low", "0.999", "--high", "0.999", "--flood", "0.9999", "--workers", "1"]
N = 12


def stop_a_run_during_a_stall(fs, tmp_path) -> tuple[subprocess.Popen, Watched]:
    """A run on `fs`, its write hanging on the stalled volume, asked to stop: it says at once what the stop waits
    for (the stalled write, on which filesystem)."""
    src = write_demo_source(tmp_path / "src.jsonl", n=N)
    assert fs.run(["init", "B", "--source", src]).returncode == 0
    hold = Hold(tmp_path / "hold", 6)
    env = {**hold.env, "HSBUILD_STALL_S": "2", "HSBUILD_GROUP_SAMPLES": "1"}
    p = fs.popen(["run", "B", *RUN_ARGS], env=env)
    err = Watched(p)
    hold.wait(1, p)
    fs.stall()
    hold.release()  # the 6th sample is extracted and its write hangs
    err.wait_for("STALLED:", 60)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    err.wait_for("waiting for the stalled", 10)
    assert time.monotonic() - t0 < 5  # said at once, not once the volume answers
    said = next(ln for ln in err.err if "waiting for the stalled" in ln)
    assert str(fs.mnt) in said and "fuse" in said, said
    return p, err


def test_ctrl_c_during_a_stall_says_what_it_waits_for_then_stops_safely(powercut, tmp_path):
    fs = powercut(threads=True)
    build = fs.path("B")
    try:
        p, err = stop_a_run_during_a_stall(fs, tmp_path)
        time.sleep(3)
        assert p.poll() is None  # it waits for the write (nothing half-done is given up)
    finally:
        fs.thaw()
    out, _ = err.communicate(timeout=120)
    assert p.returncode == 130, "".join(err.err)
    assert "interrupted at a safe point" in out, out
    written = json.loads(hsbuild("sql", "--json", build, "SELECT count(*) AS n FROM events WHERE kind = 'written'").stdout)
    assert written[0]["n"] >= 5
    assert hsbuild("verify", build).returncode == 0
    r = fs.run(["resume", "B", *RUN_ARGS])
    assert r.returncode == 0, r.stderr[-3000:]
    r = hsbuild("sql", "--json", build, "SELECT count(*) AS n, count(DISTINCT sample_id) AS d FROM events "
                                   "WHERE kind = 'written'")
    assert json.loads(r.stdout) == [{"n": N, "d": N}]


def test_a_second_ctrl_c_during_a_stall_says_the_exit_waits_for_the_stalled_write(powercut, tmp_path):
    """The second Ctrl-C exits at once, but the lock record's note waits for the volume: the run says so at once
    (through the CLI's printer, from a thread: never from the signal handler itself), exits 130 once the volume
    answers, and what was committed is intact."""
    fs = powercut(threads=True)
    build = fs.path("B")
    try:
        p, err = stop_a_run_during_a_stall(fs, tmp_path)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        err.wait_for("exiting as soon as the stalled", 10)
        assert time.monotonic() - t0 < 5
        said = next(ln for ln in err.err if "exiting as soon as the stalled" in ln)
        assert str(fs.mnt) in said and "fuse" in said and said.rstrip().endswith("(still safe)"), said
        time.sleep(1)
        assert p.poll() is None  # the lock record's note waits for the volume
    finally:
        fs.thaw()
    out, _ = err.communicate(timeout=120)
    assert p.returncode == 130, "".join(err.err)
    assert "interrupted at a safe point" not in out, out  # exited at once, not at a safe point
    record = parse_record(layout(build).lock.read_bytes())
    assert record and record["interrupted"]["signal"] == "SIGINT", record  # not taken for a crash by the next owner
    assert hsbuild("verify", build).returncode == 0
