"""Segments describe themselves: a lost log is rebuilt from their manifests, and a log that lost commits (its
WAL deleted after a kill -9) is caught up by resume, which adopts the durable samples after reading them back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import forked
import torch
from conftest import wait_written
from test_run import assert_bit_exact

from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build


def _states(build) -> dict[str, bytes]:
    return {it["sample_id"]: it["aux_hidden_state"].view(torch.int16).numpy().tobytes() + it["hidden_state"].view(
        torch.int16).numpy().tobytes() for it in HiddenStateDataset(build)}


def test_a_lost_log_is_rebuilt_from_the_segments(make_build, cli):
    build = make_build(n=14)
    assert run_build(build, RunOptions()).exit_code == 0
    before = _states(build)
    lay = layout(build)
    for p in lay.root.glob("events.duckdb*"):
        p.unlink()

    cp = cli("status", build)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert f"hsbuild rebuild-log {lay.root}" in cp.stderr.splitlines()[0]

    cp = cli("rebuild-log", build)
    assert cp.returncode == 0, cp.stderr
    assert "14 of 14 sample(s) written" in cp.stdout and "read back 14 sample(s)" in cp.stdout, cp.stdout
    cp = cli("verify", build, "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert json.loads(cp.stdout)["ok"] == 14
    assert _states(build) == before  # the same bytes, found again
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0 and "wrote 0" in cp.stdout, cp.stdout + cp.stderr


def test_a_damaged_log_is_kept_aside_and_rebuilt(make_build, cli):
    build = make_build(n=6)
    assert run_build(build, RunOptions()).exit_code == 0
    lay = layout(build)
    lay.events.write_bytes(os.urandom(50_000))  # garbage where the log was
    cp = cli("rebuild-log", build)
    assert cp.returncode == 0, cp.stderr
    kept = [p.name for p in lay.root.iterdir() if p.name.startswith("events.duckdb.damaged-")]
    assert kept and f"kept the old log as {kept[0]}" in cp.stdout
    cp = cli("verify", build)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_resume_adopts_what_a_lost_wal_forgot(make_build, cli, hold):
    """kill -9 mid-run, then the WAL is lost: the log rolls back to `init`. Resume finds the durable samples in
    the segments' manifests, checks their bytes and records them instead of extracting everything again."""
    n = 60
    build = make_build(n=n, workers="auto")
    lay = layout(build)
    wal = lay.wal
    # the run must still be going when killed, for certain: its worker holds with its 21st sample started (the
    # test hook), the 20 before it made durable in groups of 4 and committed
    h = hold(21)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                     env={**h.env, "HSBUILD_GROUP_SAMPLES": "4"})
    # killed once its WAL holds commits, and before the run's end (whose closing checkpoint folds the WAL away)
    h.wait(proc=p)
    wait_written(build, 20, p)
    assert p.poll() is None, "the run ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert wal.exists(), "the run's commits should still be in the WAL"
    with EventLog(lay.events, read_only=True) as log:
        assert log.count("written") >= 15  # (read with the WAL: read-only, it leaves it as it is)
    wal.unlink()
    with EventLog(lay.events, read_only=True) as log:
        assert log.count("written") == 0  # rolled back to init

    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "the log was behind the data" in cp.stderr
    adopted = int(cp.stderr.split("adopted ")[1].split()[0])
    assert adopted >= 15
    with EventLog(lay.events, read_only=True) as log:
        _, rows = log.query("SELECT sample_id, count(*) FROM events WHERE kind = 'written' GROUP BY 1")
        assert len(rows) == n and all(k == 1 for _, k in rows)  # adopted or extracted, each exactly once
        wrote = log.query("SELECT count(*) FROM events WHERE kind = 'written' AND detail LIKE '%adopted%'")[1][0][0]
        assert wrote == adopted
    assert assert_bit_exact(build) == n


def test_a_damaged_log_is_one_line_naming_the_repair(make_build, cli):
    """Emptied, garbage or truncated: every command says so in one line and names `hsbuild rebuild-log`."""
    damages = {"empty": lambda p: p.write_bytes(b""), "garbage": lambda p: p.write_bytes(os.urandom(9000)),
               "truncated": lambda p: os.truncate(p, 3000)}
    for name, damage in damages.items():
        build = make_build(n=3, name=name)
        damage(layout(build).events)
        for cmd in (["status"], ["sql", "SELECT 1"], ["resume", "--no-progress"], ["verify"]):
            cp = cli(cmd[0], build, *cmd[1:])
            assert cp.returncode == 2 and "Traceback" not in cp.stderr, (name, cmd, cp.stderr)
            lines = cp.stderr.strip().splitlines()
            assert len(lines) == 1 and "hsbuild rebuild-log" in lines[0], (name, cmd, cp.stderr)
