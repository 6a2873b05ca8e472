"""Regression tests for defects of the run loop found by trying to break builds (issue 14)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import Watched, mounted_tmpfs, random_rows, wait_written, worker_pids, write_jsonl

from builder.layout import layout
from builder.log.events import Event, EventLog, detail
from builder.log.session import OwnerSession
from builder.run.coordinator import RunOptions, run_build
from builder.run.dispatch import Outbox
from builder.run.messages import Stop
from builder.store import segment as segment_mod
from builder.store.segment import SegmentWriter, init_data_group, sample_files


def _events(build, sql: str) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts(sql)


def test_a_worker_that_finishes_while_the_coordinator_is_busy_is_not_reported_dead(make_build, monkeypatch):
    """The coordinator stalls (a slow commit) right after telling each worker to stop: the workers seal, say
    `exit` and are gone before it reads their last messages. Those messages are still read; nobody died."""
    build = make_build(6, seed=21)
    real_send = Outbox.send  # (what the run sends each worker, from the run's loop)

    def send_then_stall(outbox, obj):
        real_send(outbox, obj)
        if isinstance(obj, Stop):  # stalled until a worker has sealed its segment and exited (10 s at most)
            alive = len(worker_pids(os.getpid()))
            deadline = time.monotonic() + 10
            while len(worker_pids(os.getpid())) >= alive and time.monotonic() < deadline:
                time.sleep(0.05)

    monkeypatch.setattr(Outbox, "send", send_then_stall)
    echoed: list[str] = []
    report = run_build(build, RunOptions(workers=2), echo=echoed.append)
    assert (report.outcome, report.exit_code) == ("completed", 0), echoed
    assert not any("died" in m for m in echoed), echoed
    assert report.written == 6
    states = _events(build, "SELECT state, count(*) AS n FROM samples GROUP BY 1")
    assert states == [{"state": "written", "n": 6}]
    sealed = _events(build, "SELECT segment, reason FROM events WHERE kind = 'segment_sealed'")
    written_segments = {r["segment"] for r in _events(build, "SELECT segment FROM samples")}
    assert {r["segment"] for r in sealed} == written_segments and all(r["reason"] is None for r in sealed)


def _fill(path: Path) -> None:
    """Fill the volume holding `path` to the last byte (ENOSPC), as another process would."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\xff" * (64 << 10))
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\xff" * 512)
    except OSError:
        pass
    os.close(fd)


@pytest.fixture
def full_data_volume(make_build, tmp_path):
    """A build whose data/ is a real small tmpfs, filled to the brim by another file (the log lives on the
    ordinary disk, so only segment data meets ENOSPC). Yields (build, filler)."""
    build = make_build(6, seed=22)
    data = layout(build).data
    group = (data / "zarr.json").read_bytes()
    (data / "zarr.json").unlink()
    with mounted_tmpfs(data, "4m"):
        (data / "zarr.json").write_bytes(group)
        filler = data / "filler.bin"
        _fill(filler)
        yield build, filler


def test_enospc_while_creating_a_segment_pauses_and_retries_without_counting(full_data_volume, cli):
    build, filler = full_data_volume
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--flood", "1.0"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            cp = cli("sql", build, "SELECT count(*) AS n FROM events WHERE kind = 'failed'", "--json")
            if cp.returncode == 0 and json.loads(cp.stdout)[0]["n"] >= 1:
                break
            time.sleep(0.3)
        time.sleep(1.0)
        assert p.poll() is None  # paused, alive, not finished with failures
        filler.unlink()  # space returns
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    failed = _events(build, "SELECT DISTINCT reason FROM events WHERE kind = 'failed'")
    assert failed == [{"reason": "no_space"}]  # an environment failure, not counted against --max-attempts
    paused = _events(build, "SELECT reason FROM events WHERE kind = 'paused'")
    assert {"reason": "disk_full"} in paused
    assert _events(build, "SELECT state, count(*) AS n FROM samples GROUP BY 1") == [{"state": "written", "n": 6}]
    # the half-created segments of the failed attempts are gone: every segment left holds written samples
    live = {r["segment"] for r in _events(build, "SELECT segment FROM samples")}
    assert {s.name for s in layout(build).data.iterdir() if s.is_dir() and s.name.startswith("seg-")} == live


def test_samples_a_full_disk_sent_back_are_pending_as_the_run_says_not_failed(full_data_volume, cli):
    """Issue 41: a transient failure (here `no_space`; `server_unavailable` when an inference server dies) sends
    the sample back to pending, as the run says. Stopped while it waits for space, the run ends "failed 0", and
    the build agrees: no "N sample(s) in the build are failed", `status` and the `samples` and `runs` views
    count them pending (requeued), not failed; the next run extracts them."""
    build, filler = full_data_volume
    # --low 0.05: the pause for the full volume lasts (the log's volume never gets that empty)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1",
                      "--low", "0.05", "--high", "1.0", "--flood", "1.0"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and p.poll() is None, "the run did not pause on the full volume"
            cp = cli("status", build, "--json")
            if cp.returncode == 0 and json.loads(cp.stdout).get("requeued"):
                break
            time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "wrote 0, failed 0" in out and "in the build are failed" not in out, out + err
    sent_back = _events(build, "SELECT sample_id, state, error FROM samples WHERE error IS NOT NULL")
    assert sent_back and all((r["state"], r["error"]) == ("pending", "no_space") for r in sent_back), sent_back
    st = json.loads(cli("status", build, "--json", check=True).stdout)
    assert (st["failed"], st["requeued"], st["pending"]) == (0, len(sent_back), 6), st
    assert _events(build, "SELECT failed FROM runs") == [{"failed": 0}]
    filler.unlink()
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0 and "wrote 6, failed 0" in cp.stdout, cp.stdout + cp.stderr


def test_a_sample_too_big_for_the_volume_fails_and_the_run_goes_on(tmp_path, cli):
    """One sample needs more than the whole volume allows below `flood`: it can never be written. It fails
    with a reason saying so (instead of pausing the run forever), the user is told, the others are written."""
    with mounted_tmpfs(tmp_path / "vol", "16m") as mnt:
        rows = random_rows(5, seed=23, lo=20, hi=40)
        rows.append({"id": "big", "input_ids": [7] * 2100})  # 2100 tokens x ~8 KB/token: ~17 MB > 95% of 16 MB
        src = write_jsonl(tmp_path / "src.jsonl", rows)
        build = mnt / "build"
        cp = cli("init", build, "--source", src, "--model",
                 "builtin:hidden=1024,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128")
        assert cp.returncode == 0, cp.stderr
        try:
            cp = cli("run", build, "--no-progress", "--allow-overcommit", timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the run never ended: the too-big sample paused it forever")
        assert cp.returncode == 1, cp.stderr  # finished; a sample failed
        assert "big" in cp.stderr and "too big" in cp.stderr  # told, by name
        rows = {r["sample_id"]: r for r in _events(build, "SELECT sample_id, state, error, error_detail FROM samples")}
        assert rows["big"]["state"] == "failed" and rows["big"]["error"] == "too_big_for_volume"
        message = json.loads(rows["big"]["error_detail"])["message"]
        assert "bytes" in message and "flood" in message
        assert all(r["state"] == "written" for sid, r in rows.items() if sid != "big")


def test_a_sample_interrupted_too_often_is_not_retried_and_is_reported(make_build, cli):
    """A sample that took the whole run down with it five times (e.g. the coordinator OOM-killed while it was
    in flight) is left `started` each time; resume must not try it forever."""
    build = make_build(5, seed=24)
    with EventLog(layout(build).events) as log:
        fp = {r["sample_id"]: r["fingerprint"] for r in log.query_dicts("SELECT * FROM source_samples")}
        for k in range(5):  # five runs, each died with s0001 in flight (and s0002 once)
            run = f"crashed{k}"
            log.append([Event("run_started", run_id=run, detail=detail(workers=1)),
                        Event("started", run_id=run, sample_id="s0001", fingerprint=fp["s0001"], attempt=k + 1,
                              worker=0)]
                       + ([Event("started", run_id=run, sample_id="s0002", fingerprint=fp["s0002"], attempt=1,
                                 worker=0)] if k == 0 else []))
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 1, cp.stderr  # finished; one sample is failed for good
    assert "1 interrupted too often" in cp.stderr  # the replay says so
    rows = {r["sample_id"]: r for r in _events(build, "SELECT sample_id, state, attempts, error FROM samples")}
    assert rows["s0001"]["state"] == "failed" and rows["s0001"]["error"] == "interrupted_too_often"
    assert rows["s0001"]["attempts"] == 5  # not started again
    assert all(r["state"] == "written" for sid, r in rows.items() if sid != "s0001")  # s0002: retried once
    st = cli("status", build)
    assert "interrupted_too_often 1" in st.stdout, st.stdout
    again = cli("resume", build, "--no-progress")  # stays given up
    assert again.returncode == 1, again.stderr
    assert _events(build, "SELECT count(*) AS n FROM events WHERE kind = 'started' AND sample_id = 's0001'") \
        == [{"n": 5}]


def test_a_failing_shard_write_leaves_no_file_of_the_group(tmp_path):
    """One shard write of a group fails (a real OS error: the file already exists, O_EXCL refuses it) while the
    big shards are still being written. When `write` raises, every sibling write has finished and every file of
    the group is gone again; the file in the way (not ours) is left alone."""
    data = tmp_path / "data"
    init_data_group(data, {})
    h, c, n = 2048, 256, 1024  # 4 chunks per field; hidden-state chunks of 1 MB, aux chunks of 3 MB
    w = SegmentWriter(data, "seg-x", h, 3, c, "zstd:19", shard_chunks=2).create()  # 2 shards per field
    g = torch.Generator().manual_seed(0)
    aux, final = (torch.randn(n, 3 * h, generator=g).to(torch.bfloat16),
                  torch.randn(n, h, generator=g).to(torch.bfloat16))
    ids, mask = np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8)
    in_the_way = sample_files(w.path, "loss_mask", 0, n)[-1]
    in_the_way.write_bytes(b"in the way")
    before = {p for p in w.path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError):
        w.write(ids, mask, aux, final, sample_id="s", fingerprint="f", attempt=1)
    segment_mod._io_pool().shutdown(wait=True)  # let any straggler write finish (there must be none)
    segment_mod._POOLS.pop("hsbuild-write")
    assert {p for p in w.path.rglob("*") if p.is_file()} == before
    assert in_the_way.read_bytes() == b"in the way"


class _Terminal:
    """Progress bar and echo sharing one stream, as in the CLI (both write to stderr). Like Python's buffered
    stderr, a write that starts while another write to the stream is under way fails (a reentrant call)."""

    def __init__(self, interrupt_after: int):
        self.lines: list[str] = []
        self.writing = False
        self.done = 0
        self.interrupt_after = interrupt_after
        self.interrupted = False
        self.closed_at: float | None = None

    def echo(self, line: str) -> None:
        if self.writing:
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")
        self.lines.append(line)

    def start(self, total: int, label: str) -> None:
        pass

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        self.writing = True
        try:
            self.done += done
            if self.done >= self.interrupt_after and not self.interrupted:
                self.interrupted = True
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the bar is being drawn
                for _ in range(1000):  # drawing goes on; Python runs signal handlers between these steps
                    pass
        finally:
            self.writing = False

    def close(self) -> None:
        self.closed_at = time.monotonic()


def test_ctrl_c_while_the_progress_bar_draws_stops_cleanly_and_says_so_once(make_build):
    build = make_build(40, seed=25)
    term = _Terminal(interrupt_after=3)
    report = run_build(build, RunOptions(workers=2, progress=term), echo=term.echo)
    assert term.interrupted
    assert (report.outcome, report.exit_code) == ("interrupted", 130)
    assert sum("stopping at a safe point" in line for line in term.lines) == 1
    assert _events(build, "SELECT outcome FROM runs") == [{"outcome": "interrupted"}]
    assert {r["state"] for r in _events(build, "SELECT state FROM samples")} <= {"written", "pending"}


class _LateCtrlC(_Terminal):
    """Ctrl-C arrives as the run loop's last turn ends (here: as the bar closes), the moment the last workers'
    final reports were drawn and the loop has no next turn in which to say it is stopping."""

    def close(self) -> None:
        self.interrupted = True
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # Python runs the handler between these steps
            pass
        super().close()


def test_ctrl_c_as_the_run_loop_ends_is_still_said_once(make_build):
    build = make_build(6, seed=26)
    term = _LateCtrlC(interrupt_after=10**9)
    report = run_build(build, RunOptions(workers=2, progress=term), echo=term.echo)
    assert (report.outcome, report.exit_code) == ("interrupted", 130)
    assert sum("stopping at a safe point" in line for line in term.lines) == 1, term.lines
    assert {r["state"] for r in _events(build, "SELECT state FROM samples")} == {"written"}


class _FailingBar(_Terminal):
    """A progress display that breaks once the first sample is written: the run loop ends in an error while
    its workers are up."""

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        if done:
            raise RuntimeError("the display broke")


def test_a_run_that_ends_in_an_error_stops_its_idle_workers_at_once(make_build):
    """The run loop ends in an error (here its progress display breaks) with four workers up: they are told to
    stop and joined together, not waited for one after another (10 s each) and then killed."""
    build = make_build(8, seed=26)
    term = _FailingBar(interrupt_after=10**9)
    with pytest.raises(RuntimeError, match="the display broke"):
        run_build(build, RunOptions(workers=4, progress=term), echo=term.echo)
    shutdown = time.monotonic() - term.closed_at
    assert shutdown < 20, f"stopping 4 workers took {shutdown:.0f} s"
    assert not worker_pids(os.getpid())  # every worker is gone


def test_sigterm_to_the_process_group_stops_cleanly_and_charges_nobody(make_build, cli, hold):
    """`kill -TERM -- -PGID` (systemd, `timeout`) reaches the coordinator and its workers alike. Three such
    stops in a row must each end at a safe point (exit 130), and no healthy sample may be failed for it."""
    n = 40
    build = make_build(n, seed=27)
    for _ in range(3):
        # each run stopped a moment in, for certain: each worker holds with its 4th sample started (the test
        # hook), the 3 before it staged in a group (made durable every 0.3 s, or at the stop), until the stop
        # is under way; three runs leave work to resume
        h = hold(4)
        p = forked.Popen([sys.executable, "-m", "builder.cli", "resume", str(build), "--no-progress",
                              "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**h.env, "HSBUILD_GROUP_SECONDS": "0.3"})
        w = Watched(p)
        try:
            h.wait(proc=p)
            os.killpg(p.pid, signal.SIGTERM)
            w.wait_for("stopping at a safe point")
            h.release()
            out, err = w.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        assert p.returncode == 130, err
        assert "died" not in err, err
        assert _events(build, "SELECT outcome FROM runs")[-1] == {"outcome": "interrupted"}, err
        failed = _events(build, "SELECT sample_id, reason, detail FROM events WHERE kind = 'failed'")
        assert failed == [], (failed, err)
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert _events(build, "SELECT state, count(*) AS n FROM samples GROUP BY 1") == [{"state": "written", "n": n}]


def test_ctrl_c_with_a_stopped_worker_gives_up_on_it_names_it_and_resume_finishes(make_build, cli, hold):
    """A worker frozen by SIGSTOP never finishes its sample. One Ctrl-C must still end the run (after a bound,
    here 3 s via HSBUILD_STOP_GRACE), name the worker, and leave its sample to resume, not fail it."""
    # far from its end when a worker is frozen, for certain: each worker holds with its 4th sample started (the
    # test hook), the 3 before it written (one a group). Enough samples that both get 4, although a worker may
    # queue 64 small ones (QUEUE_SAMPLES) before the other is ready
    n = 100
    build = make_build(n, seed=28)
    h = hold(4)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "2"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                     env={**h.env, "HSBUILD_STOP_GRACE": "3", "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        held = h.wait(workers=2, proc=p)
        wait_written(build, 3, p)
        workers = worker_pids(p.pid)
        assert p.poll() is None and len(workers) == 2 and held[0] in workers, (held, workers)
        frozen = held[0]
        os.kill(frozen, signal.SIGSTOP)
        p.send_signal(signal.SIGINT)
        h.release()  # the other worker goes on to a safe point; the frozen one cannot
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("one Ctrl-C with a stopped worker never ended the run")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert f"pid {frozen}" in err and "did not stop" in err, err
    assert _events(build, "SELECT count(*) AS n FROM events WHERE kind = 'failed'") == [{"n": 0}]
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    states = {r["state"]: r["n"] for r in _events(build, "SELECT state, count(*) AS n FROM samples GROUP BY 1")}
    # a worker frozen between its group's data barrier and its report leaves durable samples the log lacks:
    # resume adopts them after reading them back (`verified`), never extracts or fails them
    assert set(states) <= {"written", "verified"} and sum(states.values()) == n, states
    assert ("adopted" in cp.stdout + cp.stderr) == ("verified" in states), cp.stdout + cp.stderr



def test_the_run_holds_its_stop_handlers_until_its_log_is_closed_and_its_lock_released(make_build, monkeypatch):
    """A SIGTERM in a run's last moments (closing its log: a fold checkpoint can take seconds on a large build;
    releasing its lock) is a stop request, not the default action that kills the process mid-teardown. Once the
    run returns, the handlers it found are back."""
    build = make_build(6, seed=29)
    seen: dict[str, object] = {}
    close = EventLog.close

    def closing(self):
        seen["close"] = signal.getsignal(signal.SIGTERM)  # the last close: the run's own log
        return close(self)

    monkeypatch.setattr(EventLog, "close", closing)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert run_build(build, RunOptions()).exit_code == 0
    assert seen["close"] not in (signal.SIG_DFL, signal.SIG_IGN, before[0])
    assert getattr(seen["close"], "__func__", None) is OwnerSession._on_signal  # (the run's session's)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
