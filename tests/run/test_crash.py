"""kill -9 at random moments: a run SIGKILLed again and again, resumed each time, ends with every sample
written exactly once, every checksum matching, no overlapping locations, and the states bit-exact. A killed run
leaves nothing behind for its resume to complain of, and the resume says what it does."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from conftest import POLL_OWNER_S, hsbuild, live_count, process_group, wait_written
from test_run import assert_bit_exact

from builder.layout import layout
from builder.log.events import EventLog
from builder.store.readback import check_location

KILLS = 8
WORKERS = 2  # each killed run's workers (--workers)
GROUP = 7  # samples a worker makes durable together (HSBUILD_GROUP_SAMPLES): groups straddle the kills
HOLD_MIN, HOLD_MAX = GROUP + 1, 20  # each resume is held at a random task of each worker in this range
# what the killed runs can extract at most (each worker stops at its held task, K-1 before it), and more: no
# killed run can reach its end, whatever the machine's speed
N = KILLS * WORKERS * (HOLD_MAX - 1) + 16


def _files(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _written_count(build: Path) -> int:
    # (a run's own writes: not what it adopted before it started, which the owner also answers for)
    return live_count(build, "SELECT count(*) FROM events WHERE kind = 'written' AND run_id IN "
                             "(SELECT run_id FROM events WHERE kind = 'run_started')")


@pytest.mark.claim("crash")
def test_sigkill_at_random_moments_then_resume(make_build, hold):
    # Each resume is held by the test hook (each worker at a random task HOLD_MIN to HOLD_MAX) and never let go:
    # it is killed at a random moment before it gets there or while it holds, never after its end. By its held
    # task a worker has handed at least one full group to its committer, which writes it during the hold.
    build = make_build(N, seed=7)
    rng = random.Random(1234)
    kills = mid_run_kills = 0
    for i in range(KILLS):
        before = _written_count(build)
        held = hold(rng.randint(HOLD_MIN, HOLD_MAX))
        p = forked.Popen([sys.executable, "-m", "builder.cli", "resume", str(build), "--no-progress",
                              "--workers", str(WORKERS)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env={**held.env, "HSBUILD_GROUP_SAMPLES": str(GROUP)})
        if i % 3 == 0:  # a third of the kills at any moment, startup included
            time.sleep(rng.uniform(0.2, 4.0))
        else:  # the rest once this run is writing, a random moment later
            deadline = time.monotonic() + 120
            while p.poll() is None and time.monotonic() < deadline and _written_count(build) <= max(before, 0):
                time.sleep(POLL_OWNER_S)
            time.sleep(rng.uniform(0.0, 0.5))
        assert p.poll() is None, f"resume {i} ended (exit {p.returncode}) before its kill: {p.stderr.read()}"
        during = _written_count(build)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stderr.close()
        kills += 1
        if during > max(before, 0):
            mid_run_kills += 1
        # no writer outlives its coordinator: nothing on disk changes after the kill
        time.sleep(0.3)
        snap = _files(layout(build).data)
        time.sleep(0.7)
        assert _files(layout(build).data) == snap
    print(f"\n{kills} SIGKILLs, {mid_run_kills} of them while samples were being written")
    assert kills == KILLS
    # the kills that waited for this run's first written sample (5 of the 8) all landed mid-run
    assert mid_run_kills >= 5, f"only {mid_run_kills} kills landed while samples were being written"

    final = hsbuild("resume", build, "--no-progress", timeout=600)
    assert final.returncode == 0, final.stderr

    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
        rows = log.samples()
        per_sample = dict(log.query("SELECT sample_id, count(*) FROM events WHERE kind='written' GROUP BY 1")[1])
        runs = log.count("run_started")
    assert runs >= mid_run_kills + 1
    # written, or verified: adopted after a kill (durable in a segment, its event lost), read back first
    assert len(rows) == N and {r["state"] for r in rows} <= {"written", "verified"}
    assert set(per_sample.values()) == {1}, "a sample was committed twice"
    ranges: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        assert check_location(layout(build).data, r["segment"], r["token_start"], r["num_tokens"], r["checksums"],
                              meta["chunk_tokens"]) is None
        ranges.setdefault(r["segment"], []).append((r["token_start"], r["token_start"] + r["num_tokens"]))
    for spans in ranges.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlapping sample locations"
    assert assert_bit_exact(build) == N


def test_a_killed_run_leaks_no_semaphore_and_its_resume_says_what_it_does(make_build, hold, tmp_path):
    """kill -9 of a run whose worker has encoded groups (numcodecs' Blosc mutex made) and holds a sample: once
    the killed run's processes are gone (its resource tracker the last), nothing on the stderr the run and its
    resume share (a terminal) says "leaked semaphore objects"; the resume extracts the interrupted sample and says
    so, without telling the user to run `hsbuild resume`."""
    build = make_build(8, seed=3)
    h = hold(3)
    terminal = tmp_path / "terminal.txt"
    with open(terminal, "w") as out:
        p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                         stdout=out, stderr=out, start_new_session=True,
                         env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        h.wait(proc=p)
        wait_written(build, 2, p)
        deadline = time.monotonic() + 60
        while live_count(build, "SELECT count(*) FROM samples WHERE state = 'started'") < 1:
            assert time.monotonic() < deadline and p.poll() is None, "the held sample's start was never committed"
            time.sleep(POLL_OWNER_S)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + 60
    while process_group(p.pid):  # its fork server, worker and resource tracker: gone after it
        assert time.monotonic() < deadline, f"{process_group(p.pid)} outlived their SIGKILLed run"
        time.sleep(0.1)
    cp = hsbuild("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    said = terminal.read_text() + cp.stdout + cp.stderr
    assert "leaked semaphore" not in said, said
    assert "1 sample left `started` by a run that stopped abruptly (crash or kill) before finishing it; this run " \
           "extracts it again" in cp.stderr, cp.stderr
    assert "hsbuild resume" not in cp.stdout + cp.stderr, cp.stdout + cp.stderr
