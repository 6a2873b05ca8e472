"""The build lock: inspecting never gets in an owner's way, a lock record from another host is refused, the
owner can be found without its lock file, and messages say what actually holds a build."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest

from builder.cli.app import main
from builder.errors import EXIT_BUSY, BuildLockedError, ForeignLockError
from builder.layout import layout
from builder.log.events import EventLog, open_log
from builder.log.lock import RECORD_SIZE, BuildLock, flock_holders, inspect_lock
from builder.log.query import status_snapshot
from builder.log.server import QueryServer

HAMMER = """
import sys
from pathlib import Path
import builder.log.lock as lock
from builder.layout import layout
from builder.log.query import status_snapshot
lay = layout(sys.argv[1])
if sys.argv[2] == "probe":
    lock.PROC_LOCKS = Path("/nonexistent/proc/locks")  # the fallback: a LOCK_SH probe
print("ready", flush=True)
while True:
    if sys.argv[2] == "status":
        try:
            status_snapshot(lay)
        except Exception:
            pass
    else:
        lock.inspect_lock(lay)
"""


@pytest.mark.parametrize("mode", ["proc_locks", "probe"])
def test_inspecting_never_makes_an_owner_see_busy(make_build, mode):
    lay = layout(make_build(3))
    hammers = [subprocess.Popen([sys.executable, "-c", HAMMER, str(lay.root), m], stdout=subprocess.PIPE, text=True)
               for m in (mode, mode, "status")]
    try:
        for h in hammers:
            assert h.stdout.readline().strip() == "ready"
        busy = 0
        for _ in range(500):
            try:
                BuildLock(lay, "run").acquire().release()
            except BuildLockedError:
                busy += 1
        assert all(h.poll() is None for h in hammers)
    finally:
        for h in hammers:
            h.kill()
            h.wait()
    assert busy == 0, f"{busy} of 500 acquisitions saw a free build as busy"


def test_proc_locks_lines_name_exclusive_flock_holders(tmp_path):
    f = tmp_path / "x.lock"
    f.write_text("")
    st = os.stat(f)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    other = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino + 1}"
    text = (f"1: POSIX  ADVISORY  WRITE 11 {key} 0 EOF\n"  # a POSIX lock: not ours
            f"2: FLOCK  ADVISORY  READ  12 {key} 0 EOF\n"  # a shared probe: not an owner
            f"2: -> FLOCK  ADVISORY  WRITE 13 {key} 0 EOF\n"  # a waiter: not a holder
            f"3: FLOCK  ADVISORY  WRITE 14 {other} 0 EOF\n")  # another file
    assert flock_holders(st, text) == []
    assert flock_holders(st, text + f"4: FLOCK  ADVISORY  WRITE 15 {key} 0 EOF\n") == [15]
    with BuildLock(layout(tmp_path), "run"):  # the real table shows the real lock, and inspection sees it
        st2 = os.stat(layout(tmp_path).lock)
        assert flock_holders(st2) == [os.getpid()]
        state = inspect_lock(layout(tmp_path))
        assert state.held and state.how == "proc_locks" and state.info["proc_locks"] is True
    state = inspect_lock(layout(tmp_path))
    assert not state.held and state.info is None  # released cleanly: a blank record
    assert os.path.getsize(layout(tmp_path).lock) == RECORD_SIZE  # preallocated: rewriting needs no new block


def test_a_lock_record_from_another_host_is_refused_until_taken_over(make_build, cli):
    build = make_build(3)
    lay = layout(build)
    record = {"pid": 4242, "host": "gpu-node-17", "purpose": "run", "run_id": "f" * 32, "started_at": time.time(),
              "socket": str(lay.root / "hsbuild.sock")}
    lay.lock.write_text(json.dumps(record))
    with pytest.raises(ForeignLockError) as e:
        BuildLock(lay, "verify").acquire()
    assert "gpu-node-17" in str(e.value) and "--take-over" in str(e.value)
    assert json.loads(lay.lock.read_text()) == record  # refusing changes nothing

    cp = cli("verify", build, "--quick", "--no-progress")
    err = cp.stderr.strip().splitlines()
    assert cp.returncode == EXIT_BUSY and len(err) == 1 and "gpu-node-17" in err[0] and "--take-over" in err[0], cp.stderr
    cp = cli("verify", build, "--quick", "--no-progress", "--take-over")
    assert cp.returncode == 0, cp.stderr
    with EventLog(lay.events, read_only=True) as log:
        prev = log.query("SELECT detail->>'$.previous_owner.host' FROM events WHERE kind = 'verify_started'")[1]
    assert prev == [("gpu-node-17",)]  # the sweep records whom it took over from
    assert inspect_lock(lay).info is None  # and released cleanly: the next owner is not refused
    BuildLock(lay, "run").acquire().release()
    assert socket.gethostname() != "gpu-node-17"


def test_status_finds_a_live_owner_whose_lock_file_was_deleted(make_build, cli):
    build = make_build(3)
    lay = layout(build)
    with BuildLock(lay, "run", "r" * 32) as lock, EventLog(lay.events) as log:
        server = QueryServer(lock.socket_path, log, lambda: {"running": True, "run_id": "r" * 32,
                                                             "pid": os.getpid(), "workers": 1,
                                                             **log.progress()}).start()
        try:
            lay.lock.unlink()
            st = status_snapshot(lay)
            assert st["running"] and st["lock_file_missing"] and st["total"] == 3
            cp = cli("status", build)
            assert cp.returncode == 0, cp.stderr
            assert "running: run rrrrrrrr" in cp.stdout and "hsbuild.lock is missing" in cp.stdout
            cp = cli("sql", build, "SELECT count(*) AS n FROM samples", "--json")
            assert cp.returncode == 0 and json.loads(cp.stdout) == [{"n": 3}], cp.stderr
        finally:
            server.stop()


def test_an_unfinished_init_is_named_the_same_way_by_status_and_init(make_build, capsys):
    build = make_build(3)
    layout(build).config.unlink()  # init writes its config last: killed just before that
    assert main(["status", str(build)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unfinished init" in err and "--force" in err, err
    assert f"hsbuild init {build} --source" in err
    assert main(["init", str(build), "--source", str(build) + "-source.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--force" in err, err


def test_a_writer_blocked_by_a_reader_names_the_reader(make_build):
    lay = layout(make_build(3))
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1], "
                               "read_only=True); print('open', flush=True); time.sleep(120)", str(lay.events)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(BuildLockedError) as e:
            open_log(lay.events, wait=0.5)
    finally:
        holder.kill()
        holder.wait()
    msg = str(e.value)
    assert f"pid {holder.pid}" in msg and "a run or verify is going" not in msg, msg


def test_a_long_idle_query_gives_way_to_an_owner(make_build, cli):
    """`hsbuild sql` reading an idle build does not keep `verify` (or a run) out: it gives way at once."""
    build = make_build(5)
    lay = layout(build)
    long_sql = "SELECT count(*) FROM range(100000000000) t(i) WHERE hash(i) % 1000003 = 7"  # minutes
    reader = forked.Popen([sys.executable, "-m", "builder.cli", "sql", str(build), long_sql],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _has_open(reader.pid, lay.events):
            assert reader.poll() is None and time.monotonic() < deadline, reader.stderr.read()
            time.sleep(0.1)
        cp = cli("verify", build, "--quick", "--no-progress")
        assert cp.returncode == 0, cp.stderr
        assert "a run or verify is going" not in cp.stderr
    finally:
        reader.kill()
        reader.wait()


def _has_open(pid: int, path: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False
