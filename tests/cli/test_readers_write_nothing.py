"""`status`, `sql` and `doctor` change nothing in the build (issue 41, point 3: after an incident a user inspects a
damaged volume with them; doctor recorded a `doctor` event, which rewrote events.duckdb and hsbuild.lock, and wrote
its probe file into the build directory).

1. On a finished build, and on one whose run was killed with -9 (its WAL, a stale lock record, its socket and stall
   probe files left behind): every file and directory of the build (inode, size, mtime, ctime) is the same after
   each command, and none is added or removed.
2. On a real read-only mount (a tmpfs this test mounts and remounts `ro`: root only, skipped otherwise) with a
   build whose run was killed: they answer, and answer right (doctor: a FAIL that names the read-only mount, which
   `--force` does not override; the killed run's lock and samples as on a writable volume).
Real builds, real runs, the CLI as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import forked
import pytest
from conftest import Hold, mounted_tmpfs, random_rows, wait_written, write_jsonl

from builder.config import Watermarks
from builder.errors import EXIT_OK, EXIT_PREFLIGHT
from builder.layout import layout
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
COMMANDS = [["status"], ["status", "--json"], ["sql", "SELECT state, count(*) FROM samples GROUP BY 1"],
            ["sql", "SELECT * FROM runs", "--json"], ["doctor"], ["doctor", "--json"]]


def tree(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under `root` (and `root`): inode, size, mtime and ctime (ns). Reading changes none of them."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            p = Path(d) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def killed_run(build: Path, tmp_path: Path) -> None:
    """A run of `build` killed with -9 while its worker holds its 4th sample (3 written): it leaves its WAL, its
    lock record, its socket and stall-probe files."""
    h = Hold(tmp_path / "hold", 4)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                     env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"}, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        h.wait(1, p)
        wait_written(build, 3, p)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)
        h.release()


def test_status_sql_and_doctor_change_nothing_in_the_build(make_build, cli, tmp_path):
    done = make_build(6, name="done")
    assert cli("run", done, "--no-progress").returncode == 0
    killed = make_build(12, name="killed")
    killed_run(killed, tmp_path)
    assert layout(killed).wal.exists() and layout(killed).lock.stat().st_size  # (what a crash leaves)
    for build in (done, killed):
        for args in COMMANDS:
            before = tree(build)
            cp = cli(args[0], build, *args[1:])
            assert cp.returncode == EXIT_OK, (args, cp.stdout, cp.stderr)
            after = tree(build)
            changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
                       if before.get(k) != after.get(k)}
            assert not changed, f"hsbuild {' '.join(args)} changed {build.name}: {changed}"


def test_status_sql_and_doctor_answer_on_a_read_only_mount(tmp_path, cli):
    with mounted_tmpfs(tmp_path / "vol", "48m") as mnt:
        src = write_jsonl(tmp_path / "src.jsonl", random_rows(12, seed=2))
        build = init_build(mnt / "build", src, model=MODEL,
                           watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)).root
        killed_run(build, tmp_path)
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount a tmpfs read-only here ({r.stderr.strip()})")
        assert os.statvfs(build).f_flag & os.ST_RDONLY
        before = tree(build)

        st = cli("status", build, "--json")
        assert st.returncode == EXIT_OK, st.stderr
        st = json.loads(st.stdout)
        assert not st["running"] and st["total"] == 12 and st["written"] >= 3 and st["started"] >= 1
        assert st["written"] + st["started"] + st["pending"] == 12
        text = cli("status", build)
        assert text.returncode == EXIT_OK and text.stdout.startswith("idle: no run is going"), text.stderr

        sql = cli("sql", build, "SELECT count(*) AS n FROM samples WHERE state = 'written'", "--json")
        assert sql.returncode == EXIT_OK and json.loads(sql.stdout) == [{"n": st["written"]}], sql.stderr

        doc = cli("doctor", build, "--json")
        assert doc.returncode == EXIT_PREFLIGHT, doc.stdout + doc.stderr
        rep = json.loads(doc.stdout)
        checks = {c["name"]: c for c in rep["checks"]}
        assert {c["name"] for c in rep["checks"] if c["status"] == "fail"} == {"storage.writable"}, rep
        w = checks["storage.writable"]
        assert "read-only mount" in w["summary"] and w["data"]["overridable"] is False and "remount" in w["fix"]
        assert checks["build.lock"]["status"] == "warn" and checks["build.lock"]["data"]["stale"]
        assert checks["build.interrupted"]["data"]["started"] == st["started"]
        assert checks["storage.space"]["data"]["remaining_tokens"] == st["remaining_tokens"]
        assert not rep["recorded"]
        line = cli("doctor", build).stdout.splitlines()[-1]
        assert "--force does not override storage.writable" in line, line
        assert tree(build) == before
