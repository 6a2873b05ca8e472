"""The ballast (`BUILD/.ballast`): sized for the build and the volume, shown by `status`, and big enough for the
event log to keep committing (through a checkpoint) once it is released on a full disk."""

from __future__ import annotations

import json
import os
import threading

import pytest
from conftest import fill, mounted_tmpfs, random_rows, wait_written, write_jsonl

from builder.config import Watermarks, load_config
from builder.fsutil import dir_size
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.run.create import init_build
from builder.space.watermarks import BALLAST_MAX, BALLAST_MIN, SpaceMonitor, ballast_target, disk_usage

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
MiB = 1 << 20


def test_the_rule_scales_with_the_build_and_the_volume_and_is_capped():
    big = 10 << 40
    small_build = ballast_target(big, 300_000, 3)
    assert 4 * MiB < small_build <= 8 * MiB  # what a few samples' log can need, not 64 MiB
    assert ballast_target(big, 300_000, 40_000) > small_build  # a larger build's log needs more
    assert ballast_target(big, 300_000, 10_000_000) == BALLAST_MAX  # capped
    assert ballast_target(big, 200 * MiB, 0) == BALLAST_MAX
    assert ballast_target(500 * MiB, 300_000, 40_000) == 5 * MiB  # at most 1% of the volume ...
    assert ballast_target(24 * MiB, 300_000, 3) == BALLAST_MIN  # ... but never under the floor


def test_a_small_build_is_small_and_status_says_what_the_ballast_is(make_build, cli):
    build = make_build(3)
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    ballast = (build / ".ballast").stat().st_size
    assert BALLAST_MIN <= ballast <= 8 * MiB
    assert dir_size(build) < 16 * MiB  # was 67 MB: a 64 MiB ballast whatever the build

    cp = cli("status", build, "--json")
    st = json.loads(cp.stdout)
    assert cp.returncode == 0
    assert st["ballast_bytes"] == ballast and st["ballast_path"] == str(build / ".ballast")
    assert "event log can still commit" in st["ballast_purpose"]
    cp = cli("status", build)
    line = next(x for x in cp.stdout.splitlines() if x.startswith("ballast:"))
    assert ".ballast" in line and "disk fills" in line and "event log" in line


def test_a_ballast_left_larger_by_an_older_version_is_shrunk_by_the_next_run(make_build, cli):
    build = make_build(4)
    cp = cli("run", build, "--no-progress", "--limit", "2")
    assert cp.returncode == 0, cp.stderr
    with open(build / ".ballast", "wb") as f:  # what every build carried before: 64 MiB
        os.posix_fallocate(f.fileno(), 0, 64 * MiB)
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert (build / ".ballast").stat().st_size <= 8 * MiB


@pytest.fixture
def volume(tmp_path):
    """A real tmpfs large enough that 1% of it is more than a small build's ballast (root only)."""
    with mounted_tmpfs(tmp_path / "vol", "900m") as mnt:
        yield mnt


def test_the_released_ballast_lets_the_log_commit_through_a_checkpoint(tmp_path, volume):
    """The volume is full; the ballast is released (as on ENOSPC): the log commits more than a whole WAL's worth
    of a run's events (so DuckDB checkpoints, which it cannot survive without free blocks) and closes clean."""
    n = 20
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(n))
    lay = layout(init_build(volume / "build", src, model=MODEL,
                            watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)).root)
    mon = SpaceMonitor(lay, load_config(lay))
    mon.size_ballast(n)
    assert mon.ballast_size < disk_usage(volume).total // 100  # the build's need decides here, not the volume
    mon.ensure_ballast()
    assert lay.ballast.stat().st_size == mon.ballast_size
    fill(volume / "filler.bin")
    mon.disk_full()  # releases the ballast
    assert not lay.ballast.exists()

    log = EventLog(lay.events)
    checksums = json.dumps({f: "crc32c:0123abcd" for f in ("input_ids", "loss_mask", "hidden_state",
                                                           "aux_hidden_state")})
    committed, i = 0, 0
    wal = lay.wal
    checkpointed = False
    while committed < 60_000:
        batch = []
        for _ in range(256):
            sid, i = f"x{i:06d}", i + 1
            batch += [Event("started", run_id="r" * 32, sample_id=sid, fingerprint="f" * 16, attempt=1, worker=0),
                      Event("written", run_id="r" * 32, sample_id=sid, fingerprint="f" * 16, attempt=1, worker=0,
                            segment="seg-12345678-w00-abcdef", token_start=16 * i, num_tokens=512, nbytes=99999,
                            checksums=checksums)]
        size_before = wal.stat().st_size if wal.exists() else 0
        log.append(batch)
        committed += len(batch)
        checkpointed |= (wal.stat().st_size if wal.exists() else 0) < size_before
    assert checkpointed  # the WAL was folded into the file at least once
    log.close()
    with EventLog(lay.events, read_only=True) as ro:
        assert ro.query("SELECT count(*) FROM events WHERE run_id = ?", ["r" * 32])[1][0][0] == committed


def test_a_status_request_during_a_run_leaves_the_runs_ballast_alone(make_build, hold, monkeypatch):
    """`status` asks the run's query thread for its capacity projection while the run's own thread manages the
    ballast: the projection reads, never resizes the run's monitor (it did: each request re-sized the ballast
    for the samples left, a race with the run's own ensure/release) nor the .ballast file. 410 samples: the
    ballast the run starts with (9 MiB) is larger than the one the projection reserves once some are written
    (8 MiB), so a resize by the request would show. A real run in this process (its coordinator in the main
    thread, as the CLI runs it, so the test can read its monitor); the requests go through the run's socket,
    from another thread, while the run's worker is held at its 4th sample."""
    from builder.log.query import status_snapshot
    from builder.run import testhook
    from builder.run.coordinator import Coordinator
    from builder.run.preparation import RunOptions, prepare

    build = make_build(410, rows=random_rows(410, seed=5, lo=5, hi=8))
    lay = layout(build)
    h = hold(4)
    monkeypatch.setenv(testhook.ENV, h.spec)
    monkeypatch.setenv("HSBUILD_GROUP_SAMPLES", "1")
    coord = Coordinator(prepare(build, RunOptions(workers=1)))
    seen: dict = {}

    def ask() -> None:
        try:
            h.wait(1)
            wait_written(build, 3)  # the 3 before the held one, committed
            seen["before"] = coord.space.ballast_size, coord.space.remaining_samples, lay.ballast.stat()
            seen["answers"] = [status_snapshot(lay) for _ in range(3)]
            seen["after"] = coord.space.ballast_size, coord.space.remaining_samples, lay.ballast.stat()
        finally:
            h.release()

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    report = coord.run()
    t.join(60)
    assert report.outcome == "completed" and report.written == 410
    (size, left, ballast), (size2, left2, ballast2) = seen["before"], seen["after"]
    assert size == 9 * MiB and left == 410 and ballast.st_size == size
    assert (size2, left2) == (size, left)
    assert all(st["running"] and st["todo_samples"] < 410 and "projected_bytes" in st for st in seen["answers"]), \
        [{k: st.get(k) for k in ("running", "todo_samples", "projected_bytes")} for st in seen["answers"]]
    assert (ballast2.st_ino, ballast2.st_size, ballast2.st_mtime_ns) == (ballast.st_ino, ballast.st_size,
                                                                       ballast.st_mtime_ns)
