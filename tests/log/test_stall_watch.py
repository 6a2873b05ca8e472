"""`StallWatch` (builder/log/stall.py) on a real stalled volume: the FUSE filesystem of ../shared/powercut,
mounted with several threads, `stall`ed (writes, fsyncs and namespace changes wait, reads and statfs go on, as
on a full Ceph pool) and `thaw`ed. Its probes notice the stall within the limit, name what hangs, where and on
which filesystem, and the end of the stall is noticed too; a tracked operation that hangs is named the same way."""

from __future__ import annotations

import os
import threading
import time

from builder.log.stall import PROBE_NAME, StallWatch, filesystem_of


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_probes_notice_a_stalled_volume_and_its_end(powercut):
    fs = powercut(threads=True)
    d = fs.path("build")
    d.mkdir()
    changes = []
    watch = StallWatch([d], limit_s=2.0, probe_every=0.5, tick=0.1,
                       on_change=lambda new, old: changes.append((new, old))).start()
    try:
        _wait(lambda: (d / PROBE_NAME).exists(), 10, "a first probe")
        time.sleep(1)
        assert watch.current() is None and changes == []  # a healthy volume: no stall
        fs.stall()
        t0 = time.monotonic()
        stall = _wait(watch.current, 20, "the stall to be noticed")
        assert 2.0 <= time.monotonic() - t0 < 10
        assert stall.what == "write probe" and stall.path == str(d / PROBE_NAME)
        assert stall.filesystem.startswith("fuse") and str(fs.mnt) in stall.filesystem, stall
        assert "pending" in stall.describe() and stall.as_dict()["pending_s"] >= 2.0
        assert len(changes) == 1 and changes[0][0] == stall
        time.sleep(1.5)
        assert watch.current() is not None and watch.current().since == stall.since  # the same stall goes on
        fs.thaw()
        _wait(lambda: watch.current() is None, 20, "the end of the stall")
        assert len(changes) == 2 and changes[1][0] is None and changes[1][1].since == stall.since
    finally:
        watch.stop()


def test_a_tracked_operation_that_hangs_is_named(powercut):
    fs = powercut(threads=True)
    d = fs.path("build")
    d.mkdir()
    watch = StallWatch([], limit_s=1.0, tick=0.1).start()  # no probes: only what the owner tracks
    fs.stall()
    done = threading.Event()

    def commit() -> None:
        with watch.track("log commit", d / "events.duckdb.wal"):
            with open(d / "events.duckdb.wal", "wb") as f:
                f.write(b"x")
                f.flush()
                os.fsync(f.fileno())
        done.set()

    threading.Thread(target=commit, daemon=True).start()
    try:
        stall = _wait(watch.current, 15, "the hung commit to be named")
        assert stall.what == "log commit" and stall.path.endswith("events.duckdb.wal")
        assert stall.filesystem.startswith("fuse") and str(fs.mnt) in stall.filesystem, stall
        assert not done.is_set()
    finally:
        fs.thaw()
    _wait(done.is_set, 20, "the commit to go through after the thaw")
    _wait(lambda: watch.current() is None, 5, "the stall to end")
    watch.stop()


def test_filesystem_of_names_the_mount():
    text = ("/dev/sda1 / ext4 rw 0 0\n"
            "10.0.0.1:/ /mnt/ceph\\040pool ceph rw 0 0\n")
    assert filesystem_of("/mnt/ceph pool/b", text) == "ceph at /mnt/ceph pool"
    assert filesystem_of("/home/x", text) == "ext4 at /"
