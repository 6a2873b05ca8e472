"""Storage awareness on a real small filesystem: a tmpfs this test mounts (needs root; skipped otherwise).

1. A build needing about twice the volume pauses at `high` without error, stays alive, reports the pause to
   another process, and resumes by itself when the volume grows; every sample then verifies.
2. Another process fills the volume while the run writes: the failing write is abandoned, nothing committed is
   damaged, the event log stays readable, and the run resumes once space is freed.
3. `run` refuses a build that cannot fit (exit 3) unless --allow-overcommit.
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
from conftest import random_rows, wait_for, write_jsonl

from builder.layout import layout
from builder.log.events import EventLog
from builder.log.query import status_snapshot
from builder.store.readback import check_location

MODEL = "builtin:hidden=256,layers=4,vocab=1024,heads=4,kv_heads=2,intermediate=256"


def resize(mnt: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)


def usage(mnt: Path) -> float:
    st = os.statvfs(mnt)
    return 1 - st.f_bavail / st.f_blocks


def start_run(build: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", *flags],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def live_status(cli, build: Path) -> dict:
    cp = cli("status", build, "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def assert_all_verify(build: Path) -> int:
    with EventLog(layout(build).events, read_only=True) as log:
        meta, rows = log.meta(), log.samples()
    for r in rows:
        assert r["state"] in ("written", "verified"), r
        assert check_location(layout(build).data, r["segment"], r["token_start"], r["num_tokens"], r["checksums"],
                              meta["chunk_tokens"]) is None
    return len(rows)


def make_big_build(tmp_path: Path, mnt: Path, cli, n: int) -> Path:
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(n, seed=11, lo=150, hi=250))
    build = mnt / "build"
    cp = cli("init", build, "--source", src, "--model", MODEL)
    assert cp.returncode == 0, cp.stderr
    return build


def test_pauses_at_high_and_resumes_when_the_volume_grows(tmp_path, tmpfs, cli):
    build = make_big_build(tmp_path, tmpfs, cli, n=120)  # ~2 KB/token x 24k tokens: about twice 24 MB
    refused = cli("run", build, "--no-progress")
    assert refused.returncode == 3 and "--allow-overcommit" in refused.stderr  # it will not fit: says so
    p = start_run(build, "--allow-overcommit")
    peak = 0.0
    try:
        def paused():
            nonlocal peak
            peak = max(peak, usage(tmpfs))
            st = live_status(cli, build)
            return st if st.get("paused") else None

        st = wait_for(paused, 180, "the pause", p)
        # paused on reaching high (the usage it paused at is the `paused` event's, checked below: >= high); the
        # usage now may be lower (seen: 0.877), as the log's checkpoint (WAL folded into the database file) gives
        # back a little, and the pause holds until usage falls below low
        assert st["running"] and st["pause_reason"] == "high_watermark"
        time.sleep(1.0)  # a group whose barrier began before the pause still completes (never a torn write)
        done_at_pause = live_status(cli, build)["done"]
        assert 0 < done_at_pause < 120
        time.sleep(2.0)  # then it stays paused, alive, and writes nothing more
        peak = max(peak, usage(tmpfs))
        st2 = live_status(cli, build)
        assert p.poll() is None and st2["paused"] and st2["done"] == done_at_pause
        assert peak < 0.95, f"usage reached {peak:.3f}, past the flood watermark"
        print(f"\npeak usage while paused: {peak:.4f} (high 0.90, flood 0.95)")
        resize(tmpfs, "96m")  # space returns: the run resumes by itself
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "PAUSED (high_watermark)" in err and "resumed" in err
    with EventLog(layout(build).events, read_only=True) as log:
        ev = log.query_dicts("SELECT kind, reason, detail FROM events WHERE kind IN ('paused', 'resumed') ORDER BY seq")
    assert [e["kind"] for e in ev][:2] == ["paused", "resumed"] and ev[0]["reason"] == "high_watermark"
    assert json.loads(ev[0]["detail"])["usage"] >= 0.90 and json.loads(ev[1]["detail"])["usage"] < 0.85
    assert assert_all_verify(build) == 120
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 0 and "120 of 120" in cp.stdout, cp.stdout + cp.stderr


def test_volume_filled_from_outside_while_writing(tmp_path, tmpfs, cli, hold):
    build = make_big_build(tmp_path, tmpfs, cli, n=120)  # about 40 MB: fits the volume on its own (the
    resize(tmpfs, "80m")  # projection, an upper bound with each sample's padding and per-file costs, says 64.4 MB)
    # watermarks off (high=1.0, flood=1.0): only the real ENOSPC path can stop the writes. The workers are held at
    # their 6th sample (5 written: one sample a group) while the volume fills, so writes certainly come after it
    # (left to run, the whole build was written before the filler once)
    h = hold(6)
    p = start_run(build, "--high", "1.0", "--low", "0.9", "--flood", "1.0",
                  env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    filler = tmpfs / "filler.bin"
    try:
        h.wait(1, p)
        wait_for(lambda: status_snapshot(layout(build)).get("done", 0) >= 3, 120, "first writes", p)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # another process fills the volume, but for a sliver
        try:
            block = b"\xff" * (64 << 10)
            while True:
                os.write(fd, block)
        except OSError:
            pass
        os.ftruncate(fd, max(0, os.lseek(fd, 0, os.SEEK_CUR) - (64 << 10)))
        os.close(fd)
        h.release()
        st = wait_for(lambda: (s := live_status(cli, build)).get("paused") and s, 120, "the pause", p)
        assert st["pause_reason"] == "disk_full"
        time.sleep(1.0)
        assert p.poll() is None  # no crash
        cp = cli("sql", build, "SELECT count(*) AS n FROM events WHERE reason = 'no_space'", "--json")
        assert cp.returncode == 0 and json.loads(cp.stdout)[0]["n"] >= 1  # the event log still commits
        filler.unlink()  # space returns
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert assert_all_verify(build) == 120
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        per = log.query("SELECT count(*) FROM events WHERE kind = 'written' GROUP BY sample_id HAVING count(*) > 1")[1]
    assert per == []


def test_run_refuses_a_build_that_cannot_fit(tmp_path, tmpfs, cli):
    build = make_big_build(tmp_path, tmpfs, cli, n=120)
    cp = cli("status", build)
    assert "DOES NOT FIT" in cp.stdout
    def state():
        with EventLog(layout(build).events, read_only=True) as log:
            kinds = log.query("SELECT kind, count(*) FROM events WHERE kind <> 'doctor' GROUP BY 1 ORDER BY 1")[1]
        return kinds, sorted(p.name for p in layout(build).data.iterdir())

    before = state()
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 3
    err = [line for line in cp.stderr.strip().splitlines() if line.startswith("hsbuild run: error:")]
    assert len(err) == 1 and "fit below the high watermark" in err[0] and "--allow-overcommit" in err[0]
    assert state() == before  # no run started, no sample touched (only the preflight's doctor event is new)


def test_a_full_staging_volume_is_the_one_the_pause_names(tmp_path, tmpfs, make_build):
    """The staging folder is on a volume of its own (the tmpfs), nearly full; the build's volume has room: the
    monitor pauses, and what it says names the staging volume and its figures, not the build's volume."""
    from builder.config import BuildConfig, Watermarks
    from builder.space.watermarks import SpaceMonitor

    build = make_build(2)
    cfg = BuildConfig.from_toml(layout(build).config)
    cfg.staging = str(tmpfs)
    cfg.watermarks = Watermarks(low=0.98, high=0.99, flood=0.999)
    with open(tmpfs / "filler", "wb") as f:
        f.write(b"\0" * (os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize - 40_000))
    mon = SpaceMonitor(layout(build), cfg)
    if mon._usage[0].usage >= 0.98:
        pytest.skip("the build's own volume is past 98% here: the case needs it below")
    assert mon.poll(force=True) == "high_watermark"
    said = mon.describe()
    assert said.startswith(f"staging {tmpfs} ") and f"{usage(tmpfs):.1%} used" in said, said
    assert str(build) not in said
    (tmpfs / "filler").unlink()
    assert mon.poll(force=True) is None


def test_a_write_held_back_past_high_is_the_high_watermarks_pause(tmpfs, make_build):
    """A worker's flood check (the sample's uncompressed bound plus what it has staged and committing) can come
    before the run's own poll sees the volume cross `high` (seen on a loaded machine: the run said PAUSED (flood)
    at 0.91 used). Past `high` that pause is the high watermark's, and it lasts until below `low` and the held-back
    write fits; below `high` it is flood's."""
    from builder.config import BuildConfig, Watermarks
    from builder.space.watermarks import SpaceMonitor

    cfg = BuildConfig.from_toml(layout(make_build(2)).config)
    cfg.watermarks = Watermarks(low=0.5, high=0.7, flood=0.9)
    root = tmpfs / "b"
    root.mkdir()
    mon = SpaceMonitor(layout(root), cfg)
    filler = tmpfs / "filler"
    filler.touch()

    def fill_to(frac: float) -> None:  # the volume `frac` used, whatever else is on it
        st = os.statvfs(tmpfs)
        total, others = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bavail) * st.f_frsize - filler.stat().st_size
        filler.write_bytes(b"\0" * int(total * frac - others))
        assert abs(usage(tmpfs) - frac) < 0.01

    total = os.statvfs(tmpfs).f_blocks * os.statvfs(tmpfs).f_frsize
    fill_to(0.6)  # below high
    mon.flood_block(int(total * 0.35))  # a write that would cross flood
    assert mon.poll(force=True) == "flood"
    fill_to(0.75)  # past high
    mon.flood_block(int(total * 0.5))
    assert mon.poll(force=True) == "high_watermark" and mon.describe().startswith(str(root))
    fill_to(0.6)  # below high, not below low: still paused
    assert mon.poll(force=True) == "high_watermark"
    fill_to(0.45)  # below low, but the held-back write would still cross flood (0.45 + 0.5)
    assert mon.poll(force=True) == "high_watermark"
    fill_to(0.3)  # below low, and it fits
    assert mon.poll(force=True) is None
