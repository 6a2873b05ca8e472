"""A launched server's own cgroup (builder/run/cgroup.py): a process that left the server's process group
(`setsid`) is still ended by one kill, and nothing is left of the cgroup afterwards. Real processes in a real
cgroup v2; skipped, with the reason, where this machine gives no writable cgroup v2 (the server is then contained
by its process group alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest

from builder.run.cgroup import ServerCgroup


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


@pytest.fixture
def cgroup():
    cg = ServerCgroup.create(f"hsbuild-test-{uuid.uuid4().hex[:8]}")
    if cg is None:
        pytest.skip("no writable cgroup v2 here: a launched server is contained by its process group alone")
    yield cg
    cg.kill(5)


def test_one_kill_ends_every_process_also_those_that_left_the_process_group(cgroup):
    # the "server" starts one process that leaves its process group (setsid) and one that stays, then dies with -9
    server = subprocess.Popen(["bash", "-c", "setsid sleep 300 & sleep 300 & echo ready; sleep 300"],
                              stdout=subprocess.PIPE, preexec_fn=lambda: (os.setpgrp(), cgroup.enter()))
    try:
        assert server.stdout.readline().strip() == b"ready"
        def escaped_ones() -> list[int]:
            out = []
            for p in cgroup.pids():
                try:
                    if os.getpgid(p) != server.pid:
                        out.append(p)
                except ProcessLookupError:
                    pass
            return out

        deadline = time.monotonic() + 10  # (until setsid has run in the child that calls it)
        while (len(cgroup.pids()) < 3 or not escaped_ones()) and time.monotonic() < deadline:
            time.sleep(0.05)
        members = cgroup.pids()
        assert server.pid in members and len(members) == 3, members  # (bash execs its last command)
        escaped = escaped_ones()
        assert len(escaped) == 1, "setsid did not take one of them out of the process group"
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        os.killpg(server.pid, signal.SIGKILL)  # what a process group alone can do: the escaped one survives it
        time.sleep(0.2)
        assert _alive(escaped[0])
        assert cgroup.kill(10)
        assert not any(_alive(p) for p in members)
        assert not cgroup.path.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_killed_runs_server_is_reaped_by_the_next_launch_and_a_live_runs_is_not():
    """The hsbuild that launched a server was killed with -9: its server's cgroup (named by its pid) outlives it,
    with the engine processes in it. The next launch (`reap_stale`) kills them and removes the cgroup; a cgroup of
    a live hsbuild (here: this process) is left alone."""
    from builder.run.cgroup import PREFIX, reap_stale

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale = ServerCgroup.create(f"{PREFIX}{gone.pid}-0")
    if stale is None:
        pytest.skip("no writable cgroup v2 here: a launched server is contained by its process group alone")
    live = ServerCgroup.create(f"{PREFIX}{os.getpid()}-7")
    procs = [subprocess.Popen(["sleep", "300"], preexec_fn=cg.enter) for cg in (stale, live)]
    try:
        deadline = time.monotonic() + 10
        while not (stale.pids() and live.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reap_stale(10) == 1
        procs[0].wait(10)
        assert procs[0].returncode == -signal.SIGKILL and not stale.path.exists()
        assert procs[1].poll() is None and live.pids() == [procs[1].pid]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        live.kill(5)
