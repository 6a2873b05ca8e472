"""A volume at 100%: every command works or refuses in one line (no traceback), a run survives another writer
taking every freed byte (it waits, then stops at a safe point), and once space returns `resume` completes and
`verify` passes. On a real tmpfs this test mounts (needs root; skipped otherwise).

Exit codes on a full disk (docs/design.md, "Exit codes"): resume/run/verify 3 (the log cannot commit); gc 0
(it removes what it can; an unrecorded `gc` event is a warning); doctor 4 (storage FAIL); status and sql 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import forked
import pytest
from conftest import ROOMY, fill, fill_with_log, random_rows, wait_written, write_jsonl

from builder.errors import DiskFullError
from builder.layout import layout
from builder.log.events import Event, EventBatch, EventLog
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def assert_clean(cp: subprocess.CompletedProcess, cmd: str, code: int) -> str:
    """Exit `code`, no traceback, at most one error line (which says the volume is full)."""
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out
    assert cp.returncode == code, f"hsbuild {cmd}: exit {cp.returncode}\n{out}"
    errors = [line for line in cp.stderr.splitlines() if line.startswith(f"hsbuild {cmd}: error:")]
    assert len(errors) <= 1, cp.stderr
    if code in (3,):
        assert len(errors) == 1 and "full" in errors[0], cp.stderr
        return errors[0]
    return ""


def events(build: Path) -> list[tuple]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query("SELECT seq, kind FROM events ORDER BY seq")[1]


def make(tmp_path: Path, mnt: Path, n: int) -> Path:
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(n, seed=7, lo=20, hi=60))
    return init_build(mnt / "build", src, model=MODEL, watermarks=ROOMY).root


def test_every_command_on_a_full_disk_works_or_refuses_in_one_line(tmp_path, tmpfs, cli):
    build = make(tmp_path, tmpfs, 30)
    cp = cli("run", build, "--limit", "10", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    fill(tmpfs / "filler.bin")
    before = events(build)

    assert_clean(cli("resume", build, "--no-progress"), "resume", 3)
    assert_clean(cli("run", build, "--no-progress", "--allow-overcommit", "--force"), "run", 3)
    assert_clean(cli("verify", build, "--no-progress"), "verify", 3)
    assert_clean(cli("verify", build, "--quick", "--no-progress"), "verify", 3)
    cp = cli("gc", build)
    assert_clean(cp, "gc", 0)
    assert "not recorded" in cp.stderr or "could not" in cp.stderr or "full" in cp.stderr, cp.stderr
    for flags in ([], ["--record"]):
        cp = cli("doctor", build, "--json", *flags)
        assert_clean(cp, "doctor", 4)
        rep = json.loads(cp.stdout)
        fails = {c["name"] for c in rep["checks"] if c["status"] == "fail"}
        assert "storage.space" in fails and not rep["recorded"], fails
    cp = cli("status", build, "--json")
    assert_clean(cp, "status", 0)
    assert json.loads(cp.stdout)["done"] == 10
    cp = cli("sql", build, "SELECT count(*) AS n FROM samples WHERE state = 'written'", "--json")
    assert_clean(cp, "sql", 0)
    assert json.loads(cp.stdout) == [{"n": 10}]
    assert events(build) == before  # nothing was half-recorded

    (tmpfs / "filler.bin").unlink()  # space returns
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 0 and "30 of 30" in cp.stdout, cp.stdout + cp.stderr


def test_a_batch_is_never_lost_to_a_full_disk(tmp_path, tmpfs):
    build = make(tmp_path, tmpfs, 5)
    log = EventLog(layout(build).events)
    calls = []
    batch = EventBatch(log, "r", before_commit=lambda: calls.append(1), wait=1.0)
    batch.emit(Event("run_started"))
    assert batch.flush(force=True)  # the owner is under way
    fill_with_log(log, tmpfs / "filler.bin")
    top = log._seq
    for i in range(20):
        batch.emit(Event("written", sample_id=f"s{i:04d}", attempt=1))
    batch.last_commit -= 10  # due
    calls.clear()
    assert batch.flush() is False and batch.stalled and len(batch.events) == 20  # a routine flush does not raise
    assert calls  # the ballast hook ran before the retry
    with pytest.raises(DiskFullError) as e:
        batch.flush(force=True)  # waits `wait` seconds, then gives up: once
    assert "could not commit for 1 s" in str(e.value) and len(batch.events) == 20
    assert batch.flush(force=True) is False  # later flushes keep trying, quietly
    (tmpfs / "filler.bin").unlink()  # space returns
    assert batch.flush(force=True) and not batch.stalled and batch.events == []
    rows = log.query(f"SELECT seq, sample_id FROM events WHERE seq > {top} ORDER BY seq")[1]
    log.close()
    assert rows == [(top + 1 + i, f"s{i:04d}") for i in range(20)]  # each once, in order


class Hog(threading.Thread):
    """Another writer that takes every byte the moment it is freed (the run's released ballast included)."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.stop = path, threading.Event()

    def run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        buf = b"\xff" * 4096
        try:
            while not self.stop.is_set():
                try:
                    os.write(fd, buf)
                except OSError:
                    time.sleep(0.0005)
        finally:
            os.close(fd)


def test_a_run_whose_log_cannot_commit_stops_safely_and_resumes(tmp_path, tmpfs, cli, hold):
    """Another writer takes every freed byte, the run's released ballast included: the run pauses; asked to
    stop, it cannot commit its last events, waits HSBUILD_COMMIT_WAIT, and stops in one line (exit 3), or
    commits them into the log's last page (exit 130). Either way: no traceback, and resume completes."""
    n = 40
    build = make(tmp_path, tmpfs, n)
    # far from its end when the hog starts, for certain: the worker holds with its 11th sample started (the test
    # hook), the 10 before it written (one a group), until the volume is full
    h = hold(11)
    env = {**h.env, "HSBUILD_COMMIT_WAIT": "8", "PYTHONUNBUFFERED": "1", "HSBUILD_GROUP_SAMPLES": "1"}
    # watermarks off: only real ENOSPC stops the writes
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--high", "1.0",
                          "--low", "0.9", "--flood", "1.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    hog = Hog(tmpfs / "hog.bin")
    try:
        h.wait(proc=p)
        wait_written(build, 10, p)  # samples are being written
        assert p.poll() is None, "the run ended before the disk filled: " + p.stderr.read()
        os.link(build / ".ballast", tmpfs / "ballast.held")  # the ballast's release will free nothing
        hog.start()
        deadline = time.monotonic() + 60
        while os.statvfs(tmpfs).f_bavail > 0:  # the volume is full: the worker's next write meets ENOSPC
            assert time.monotonic() < deadline, "the hog did not fill the volume"
            time.sleep(0.01)
        h.release()
        deadline = time.monotonic() + 120
        while p.poll() is None:
            cp = cli("status", build, "--json")
            if cp.returncode == 0 and json.loads(cp.stdout).get("paused"):
                break
            assert time.monotonic() < deadline, "the run did not pause on the full disk"
            time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        hog.stop.set()
        hog.join()
    finally:
        hog.stop.set()
        if p.poll() is None:
            p.kill()
    (tmpfs / "hog.bin").unlink()  # space returns
    (tmpfs / "ballast.held").unlink()
    assert "Traceback" not in out + err, err
    assert p.returncode in (3, 130), err
    if p.returncode == 3:
        errors = [line for line in err.splitlines() if line.startswith("hsbuild run: error:")]
        assert len(errors) == 1 and "could not commit" in errors[0] and "hsbuild resume" in errors[0], err
    print(f"\nstopped with exit {p.returncode}")
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 0 and f"{n} of {n}" in cp.stdout, cp.stdout + cp.stderr
