"""The manifest path (docs/design.md section 11): `rebuild-log` reads back every sample it restores, so a file lost
after a crash (a shard whose manifest survived, a manifest whose shards survived) never comes back as a live
sample: it is extracted again, never served as zeros. (The writer's side, a manifest created only once its
shards are durable: tests/store/test_manifest_order.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_rebuild_history import lose_the_log, view
from test_run import assert_bit_exact

from builder.layout import layout
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.store.segment import MANIFEST_DIR, sample_files


@pytest.fixture
def one_sample_groups(monkeypatch):
    """Each sample its own group (its own shard files): damage planted in one file hits one sample."""
    monkeypatch.setenv("HSBUILD_GROUP_SAMPLES", "1")


def test_a_lost_shard_is_not_restored_and_resume_extracts_it_again(make_build, cli, one_sample_groups):
    """After a crash a shard file is gone (s0002) or cut short (s0005) while its manifest survived, and the log
    is lost. rebuild-log reads every sample back: those two are recorded failed, never written, the reader does
    not serve them, and resume extracts them again. (Before: restored as written from the manifest alone.)"""
    build = make_build(n=8)
    b = str(build)
    assert run_build(build, RunOptions(), echo=lambda m: None).exit_code == 0
    rows = view(build)
    data = layout(build).data

    def shard(sid: str, fld: str) -> Path:
        r = rows[sid]
        return sample_files(data / r["segment"], fld, r["token_start"], r["num_tokens"])[0]

    shard("s0002", "hidden_state").unlink()
    p = shard("s0005", "aux_hidden_state")
    os.truncate(p, p.stat().st_size // 2)
    lose_the_log(build)
    cp = cli("rebuild-log", b, "--no-progress")
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert "read back 8 sample(s)" in cp.stdout and "6 good; 2 damaged" in cp.stdout, cp.stdout
    assert "s0002 (missing_data)" in cp.stdout and "s0005 (unreadable)" in cp.stdout, cp.stdout
    assert f"next: hsbuild resume {b}" in cp.stdout, cp.stdout
    after = view(build)
    assert (after["s0002"]["state"], after["s0002"]["error"], after["s0002"]["segment"]) == ("failed",
                                                                                          "missing_data", None)
    assert (after["s0005"]["state"], after["s0005"]["error"], after["s0005"]["segment"]) == ("failed",
                                                                                          "unreadable", None)
    assert {it["sample_id"] for it in HiddenStateDataset(build)} == set(rows) - {"s0002", "s0005"}
    cp = cli("resume", b, "--no-progress")
    assert cp.returncode == 0 and "wrote 2" in cp.stdout, cp.stdout + cp.stderr
    assert assert_bit_exact(build) == 8


def test_a_lost_manifest_leaves_its_samples_pending(make_build, cli, one_sample_groups):
    """A manifest gone while its shards survived (s0003), and the log lost: nothing vouches for those bytes, so
    s0003 comes back pending, the reader does not serve it (no zeros), resume extracts it again, and gc reclaims
    the bytes no manifest vouches for."""
    build = make_build(n=8)
    b = str(build)
    assert run_build(build, RunOptions(), echo=lambda m: None).exit_code == 0
    r = view(build)["s0003"]
    manifest = layout(build).data / r["segment"] / MANIFEST_DIR / f"{r['token_start']}.json"
    manifest.unlink()
    lose_the_log(build)
    cp = cli("rebuild-log", b, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "read back 7 sample(s)" in cp.stdout and "7 of 8 sample(s) written" in cp.stdout, cp.stdout
    assert "1 pending" in cp.stdout, cp.stdout
    after = view(build)
    assert (after["s0003"]["state"], after["s0003"]["segment"]) == ("pending", None)
    assert "s0003" not in {it["sample_id"] for it in HiddenStateDataset(build)}
    cp = cli("resume", b, "--no-progress")
    assert cp.returncode == 0 and "wrote 1" in cp.stdout, cp.stdout + cp.stderr
    assert view(build)["s0003"]["segment"] != r["segment"]
    old = sample_files(layout(build).data / r["segment"], "aux_hidden_state", r["token_start"], r["num_tokens"])
    assert all(p.exists() for p in old)
    assert cli("gc", b).returncode == 0
    assert not any(p.exists() for p in old)  # orphans now: nothing vouches for them
    assert assert_bit_exact(build) == 8
