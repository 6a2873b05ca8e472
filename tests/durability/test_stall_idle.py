"""The seed's situation after a reboot: no run going, the build's volume still hung (a full Ceph pool: writes do not
return, and maybe reads neither). `doctor` blocked in the kernel until the volume returned (622 s measured).
Now `status`, `sql` and `doctor` make their first calls on the build from a child process with a deadline
(HSBUILD_STALL_S, 2 s here): they answer, or end within it with one line naming the stall.

On the FUSE filesystem of ../shared/powercut (see tests/powercut_fixture.py), a finished build, then:
1. writes stall, reads go on (mounted with several threads): status and sql answer as ever (they only read);
   doctor answers and writes nothing; `doctor --probe` names the stalled write (storage.stall FAIL) within the
   deadline, and once the volume returns its probe file is gone: the build is as it was;
2. everything stalls (one FUSE thread, held by a write that waits): status and sql end within the deadline with
   one line naming the stall (exit 3), doctor with storage.stall FAIL (exit 4).
Each command is a real process: only a process can be timed out of a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from test_stall import RUN_ARGS

from builder.errors import EXIT_OK, EXIT_PREFLIGHT, EXIT_WONT_FIT
from builder.extract.demo import write_demo_source

STALL_S = 2.0
ENV = {**os.environ, "HSBUILD_STALL_S": str(STALL_S)}
SLACK_S = 20.0  # a CLI process's start and imports on a busy 2-core machine, on top of the deadline


def hs(*args, timeout=120) -> tuple[subprocess.CompletedProcess, float]:
    """`hsbuild ARGS` as a real process, and how long it took."""
    t0 = time.monotonic()
    r = forked.run([sys.executable, "-m", "builder.cli", *map(str, args)], capture_output=True, text=True,
                   timeout=timeout, env=ENV)
    return r, time.monotonic() - t0


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            try:
                st = (Path(d) / name).lstat()
            except FileNotFoundError:  # (removed since it was listed: the probe left behind, finishing)
                continue
            out[str((Path(d) / name).relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def finished_build(fs, tmp_path) -> Path:
    src = write_demo_source(tmp_path / "src.jsonl", n=4)
    assert fs.run(["init", "B", "--source", src]).returncode == 0
    r = fs.run(["run", "B", *RUN_ARGS])
    assert r.returncode == 0, r.stderr[-2000:]
    return fs.path("B")


def test_writes_stalled_readers_answer_and_doctor_probe_names_it(powercut, tmp_path):
    fs = powercut(threads=True)
    build = finished_build(fs, tmp_path)
    before = tree(build)
    fs.stall()
    try:
        st, took = hs("status", build, "--json")
        assert st.returncode == EXIT_OK and json.loads(st.stdout)["done"] == 4 and took < SLACK_S, st.stderr
        sql, took = hs("sql", build, "SELECT count(*) AS n FROM samples WHERE state = 'written'", "--json")
        assert sql.returncode == EXIT_OK and json.loads(sql.stdout) == [{"n": 4}] and took < SLACK_S, sql.stderr
        doc, took = hs("doctor", build, "--json")  # reads only: nothing of it waits
        assert doc.returncode == EXIT_OK and took < SLACK_S, doc.stdout + doc.stderr
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
        assert checks["storage.stall"]["status"] == "ok" and "--probe" in checks["storage.stall"]["summary"]
        assert fs.status()["requests_waiting_on_stall"] == 0  # none of them wrote

        doc, took = hs("doctor", build, "--json", "--probe")
        assert doc.returncode == EXIT_PREFLIGHT and STALL_S <= took < STALL_S + SLACK_S, (took, doc.stderr)
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
        stall = checks["storage.stall"]
        assert stall["status"] == "fail" and "STALLED: write probe pending" in stall["summary"], stall
        assert "fuse" in stall["data"]["stalled"]["filesystem"] and str(build) in stall["data"]["stalled"]["path"]
        assert "Ceph" in stall["summary"] and checks["storage.probe"]["status"] == "fail"
    finally:
        fs.thaw()
    # the probe left behind finishes once writes return, and removes its file: every file of the build is as it
    # was (the directory's mtime apart: --probe wrote in it)
    def files() -> dict:
        return {k: v for k, v in tree(build).items() if k != "."}

    deadline = time.monotonic() + 60
    while files() != {k: v for k, v in before.items() if k != "."} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files() == {k: v for k, v in before.items() if k != "."}


def test_a_volume_that_does_not_answer_reads_ends_readers_within_the_deadline(powercut, tmp_path):
    fs = powercut(threads=False)  # one FUSE thread: a write that waits holds every request
    build = finished_build(fs, tmp_path)
    fs.stall()
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fs.path('elsewhere'))!r}, 'w')"],
                              start_new_session=True)
    try:
        # the writer waits on its create in the kernel (lazyfs's own status waits too: its one thread is held)
        deadline = time.monotonic() + 30
        while "request_wait_answer" not in Path(f"/proc/{writer.pid}/wchan").read_text():
            assert writer.poll() is None and time.monotonic() < deadline, "the write did not wait"
            time.sleep(0.02)
        for args in (["status"], ["sql", "SELECT count(*) FROM samples"]):
            r, took = hs(*args[:1], build, *args[1:])
            assert r.returncode == EXIT_WONT_FIT and took < STALL_S + SLACK_S, (args, took, r.stdout, r.stderr)
            err = r.stderr.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"hsbuild {args[0]}: error: STALLED: "), r.stderr
            assert f"on {build}" in err[0] and "fuse" in err[0] and "Ceph" in err[0], err
        doc, took = hs("doctor", build, "--json")
        assert doc.returncode == EXIT_PREFLIGHT and took < STALL_S + SLACK_S, (took, doc.stderr)
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
        assert checks["storage.stall"]["status"] == "fail" and "STALLED:" in checks["storage.stall"]["summary"]
        assert checks["build.state"]["status"] == "warn"
        text, _ = hs("doctor", build)
        assert text.stdout.startswith(f"hsbuild doctor {build}: its volume does not answer"), text.stdout
    finally:
        fs.thaw()
        writer.wait(60)


@pytest.fixture(autouse=True)
def _no_stale_env(monkeypatch):
    monkeypatch.delenv("HSBUILD_STALL_S", raising=False)
