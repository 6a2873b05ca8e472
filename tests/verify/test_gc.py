"""Orphans and `hsbuild gc`: what crashed writers leave is reported as reclaimable, and gc removes exactly it."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from conftest import ROOMY, random_rows, write_jsonl
from verify_helpers import N_SAMPLES, TINY, copy_build, events, file_set, live, shared_template, sweep

from builder.config import load_config
from builder.errors import BuildLockedError
from builder.layout import layout
from builder.log.events import EventLog
from builder.log.lock import BuildLock
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store.segment import FIELDS, MANIFEST_DIR, SegmentWriter, sample_files
from builder.verify.gc import collect_garbage


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return shared_template(tmp_path_factory)


@pytest.fixture
def build(template, tmp_path):
    return copy_build(template, tmp_path / "b")


def _write(p: Path, data: bytes) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def make_orphans(build: Path) -> dict[str, int]:
    """Leave what crashed writers leave, through the same code paths they use. Returns orphan path -> bytes
    (a whole orphaned segment: its directory -> the bytes of all its files)."""
    lay = layout(build)
    cfg = load_config(lay)
    seg = live(build)["s0012"]["segment"]
    seg_dir = lay.data / seg
    rng = np.random.default_rng(0)
    orphans: dict[str, int] = {}

    def note(p: Path) -> None:
        orphans[str(p.relative_to(build))] = p.stat().st_size

    # zarr temp files (LocalStore writes NAME.<uuid>.partial, then renames), one of them empty
    note(_write(seg_dir / "hidden_state" / f"c.1.{uuid.uuid4().hex}.partial", rng.bytes(3000)))
    note(_write(seg_dir / "input_ids" / f"c.{uuid.uuid4().hex}.partial", b""))
    note(_write(lay.data / f"zarr.{uuid.uuid4().hex}.partial", b"{}"))
    # hsbuild temp files (fsutil.atomic_write_bytes writes .NAME.<pid>.tmp)
    note(_write(seg_dir / ".seal.json.4242.tmp", b'{"segment": "x"}'))
    note(_write(build / ".hsbuild.toml.4242.tmp", b"source = 'x'\n"))
    # a group made durable in a live segment whose `written` events were never committed: its shards and manifest
    g = zarr.open_group(store=str(seg_dir), mode="r+")
    start, n = cfg.chunk_tokens * 100000, cfg.chunk_tokens + 5
    g["input_ids"][start : start + n] = rng.integers(3, 1000, n).astype(np.int32)
    g["loss_mask"][start : start + n] = np.ones(n, np.uint8)
    g["hidden_state"][start : start + n] = rng.integers(0, 1 << 16, (n, 64)).astype(np.uint16)
    g["aux_hidden_state"][start : start + n] = rng.integers(0, 1 << 16, (n, 192)).astype(np.uint16)
    for fld in FIELDS:
        for p in sample_files(seg_dir, fld, start, n):
            note(p)
    note(_write(seg_dir / MANIFEST_DIR / f"{start}.json", json.dumps(
        {"format": 1, "segment": seg_dir.name, "group_start": start,
         "samples": [{"sample_id": "never", "token_start": start, "num_tokens": n}]}).encode()))
    # a whole segment whose writer died before its first `written` was committed
    w = SegmentWriter(lay.data, f"seg-deadbeef-w07-{uuid.uuid4().hex[:6]}", 64, 3, cfg.chunk_tokens).create()
    w.write(np.arange(40, dtype=np.int32), np.ones(40, np.uint8), torch.ones(40, 192, dtype=torch.bfloat16),
            torch.ones(40, 64, dtype=torch.bfloat16))
    orphans[str(w.path.relative_to(build))] = sum(p.stat().st_size for p in w.path.rglob("*") if p.is_file())
    return orphans


def test_orphans_are_reclaimable_not_damage_and_gc_removes_only_them(build, cli):
    orphans = make_orphans(build)
    before = file_set(build)

    cp = cli("verify", build, "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = json.loads(cp.stdout)
    assert out["damaged"] == [] and out["ok"] == N_SAMPLES
    assert out["reclaimable"]["count"] == len(orphans) and out["reclaimable"]["bytes"] == sum(orphans.values())
    assert out["reclaimable"]["by_kind"] == {"partial": 3, "tmp": 2, "shard": 4, "manifest": 1, "segment": 1}
    cp = cli("verify", build, "--quick")
    assert cp.returncode == 0 and f"reclaimable: {len(orphans)} orphan(s)" in cp.stdout
    assert f"hsbuild gc {build}" in cp.stdout

    cp = cli("gc", build, "--dry-run")
    assert cp.returncode == 0, cp.stderr
    assert all(path in cp.stdout for path in orphans)
    assert file_set(build) == before
    assert not events(build, "WHERE kind = 'gc'")

    cp = cli("gc", build)
    assert cp.returncode == 0, cp.stderr
    assert "freed" in cp.stdout
    after = file_set(build)
    gone = {p for p in before if p not in after}
    assert not set(after) - set(before)  # nothing new, nothing changed
    assert all(after[p] == before[p] for p in after)
    assert gone == {p for p in before if any(p == o or p.startswith(o + "/") for o in orphans)}
    assert not any((build / o).exists() for o in orphans)
    gc_ev = events(build, "WHERE kind = 'gc'")
    assert len(gc_ev) == 1 and json.loads(gc_ev[0]["detail"])["removed_bytes"] == sum(orphans.values())

    s = sweep(build)  # every live sample still verifies; nothing left to reclaim
    assert (s.checked, s.ok, s.orphans.count) == (N_SAMPLES, N_SAMPLES, 0)
    again = collect_garbage(build)
    assert again.orphans.count == 0 and again.removed_bytes == 0


def test_gc_keeps_segment_metadata_and_everything_referenced(build):
    before = file_set(build)
    rep = collect_garbage(build, dry_run=True)
    assert rep.orphans.count == 0
    assert collect_garbage(build).removed_files == 0
    assert file_set(build) == before


def test_gc_takes_the_build_lock(build):
    make_orphans(build)
    before = file_set(build)
    with BuildLock(layout(build), "run"):
        with pytest.raises(BuildLockedError):
            collect_garbage(build)
        with pytest.raises(BuildLockedError):
            collect_garbage(build, dry_run=True)
    assert file_set(build) == before


# -- durable groups the log does not list: a run adopts them, gc keeps them -------------------------------------

LOST_N, LOST_FIRST = 16, 6


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """A real build whose log lost its last run's commits, as a deleted WAL loses them: 6 samples logged (the
    first run), the other 10 durable in the second run's segment (groups of two samples), which no `written`
    event names. This is what a run stopped by a full disk, a crash or a lost WAL leaves, and what the next
    run adopts."""
    root = tmp_path_factory.mktemp("lost-wal")
    src = write_jsonl(root / "source.jsonl", random_rows(LOST_N, seed=7, lo=20, hi=150))
    lay = init_build(root / "b", src, watermarks=ROOMY, model=TINY)
    old = os.environ.get("HSBUILD_GROUP_SAMPLES")
    os.environ["HSBUILD_GROUP_SAMPLES"] = "2"
    try:
        assert run_build(lay.root, RunOptions(limit=LOST_FIRST), echo=lambda m: None).exit_code == 0
        saved = {p.name: p.read_bytes() for p in lay.root.glob("events.duckdb*")}  # the log after run 1
        assert run_build(lay.root, RunOptions(), echo=lambda m: None).exit_code == 0
    finally:
        if old is None:
            del os.environ["HSBUILD_GROUP_SAMPLES"]
        else:
            os.environ["HSBUILD_GROUP_SAMPLES"] = old
    for p in lay.root.glob("events.duckdb*"):
        p.unlink()
    for name, data in saved.items():
        (lay.root / name).write_bytes(data)
    assert len(_done(lay.root)) == LOST_FIRST
    return lay.root


def _done(build: Path) -> dict[str, dict]:
    return {s: r for s, r in live(build).items() if r["state"] in ("written", "verified")}


def _unlogged_segment(build: Path) -> str:
    logged = {r["segment"] for r in _done(build).values()}
    (seg,) = [s for s in os.listdir(layout(build).data) if s.startswith("seg-") and s not in logged]
    return seg


def _tear(build: Path) -> dict[str, int]:
    """What is truly orphaned besides: a group torn before its manifest was durable (its shard files only) in
    the unlogged segment, and a new segment whose only group tore the same way. Returns path -> bytes."""
    lay = layout(build)
    cfg = load_config(lay)
    seg_dir = lay.data / _unlogged_segment(build)
    rng = np.random.default_rng(1)
    g = zarr.open_group(store=str(seg_dir), mode="r+")
    start, n = cfg.chunk_tokens * 100000, cfg.chunk_tokens + 5
    g["input_ids"][start : start + n] = rng.integers(3, 1000, n).astype(np.int32)
    g["hidden_state"][start : start + n] = rng.integers(0, 1 << 16, (n, 64)).astype(np.uint16)
    torn = {str(p.relative_to(build)): p.stat().st_size
            for f in ("input_ids", "hidden_state") for p in sample_files(seg_dir, f, start, n)}
    w = SegmentWriter(lay.data, f"seg-deadbeef-w03-{uuid.uuid4().hex[:6]}", 64, 3, cfg.chunk_tokens).create()
    w.write(np.arange(40, dtype=np.int32), np.ones(40, np.uint8), torch.ones(40, 192, dtype=torch.bfloat16),
            torch.ones(40, 64, dtype=torch.bfloat16))
    for m in (w.path / MANIFEST_DIR).iterdir():
        m.unlink()
    torn[str(w.path.relative_to(build))] = sum(p.stat().st_size for p in w.path.rglob("*") if p.is_file())
    return torn


def _resume(cli, build: Path) -> int:
    """`hsbuild resume`: how many samples it adopted (0 when the log was not behind the data)."""
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    m = re.search(r"adopted (\d+) after reading them back", cp.stderr)
    return int(m.group(1)) if m else 0


def _written(build: Path) -> dict[str, int]:
    with EventLog(layout(build).events, read_only=True) as log:
        _, rows = log.query("SELECT sample_id, count(*) FROM events WHERE kind = 'written' GROUP BY 1")
        adopted = log.query("SELECT count(*) FROM events WHERE kind = 'written' AND detail LIKE '%adopted%'")
    return {"samples": len(rows), "max_per_sample": max(k for _, k in rows), "adopted": adopted[1][0][0]}


def test_gc_after_a_lost_wal_reclaims_nothing_a_run_adopts(rolled_back, tmp_path, cli):
    with_gc, without = copy_build(rolled_back, tmp_path / "gc"), copy_build(rolled_back, tmp_path / "plain")
    torn = _tear(with_gc)
    before = file_set(with_gc)
    unlogged = LOST_N - LOST_FIRST

    cp = cli("verify", with_gc, "--json")  # the durable, unlogged groups are neither damage nor reclaimable
    assert cp.returncode == 0, cp.stdout + cp.stderr
    rec = json.loads(cp.stdout)["reclaimable"]
    assert rec["count"] == len(torn) and rec["bytes"] == sum(torn.values()), rec
    assert rec["adoptable"]["samples"] == unlogged and rec["adoptable"]["groups"] == unlogged // 2, rec

    cp = cli("gc", with_gc, "--dry-run")
    assert cp.returncode == 0, cp.stderr
    assert all(p in cp.stdout for p in torn) and cp.stdout.count("would remove") == len(torn), cp.stdout
    assert f"kept {unlogged} durable sample(s)" in cp.stdout and f"hsbuild resume {with_gc}" in cp.stdout
    assert file_set(with_gc) == before

    cp = cli("gc", with_gc)
    assert cp.returncode == 0, cp.stderr
    assert f"kept {unlogged} durable sample(s) in {unlogged // 2} group(s)" in cp.stdout, cp.stdout
    assert f"adopt them with: hsbuild resume {with_gc}" in cp.stdout
    after = file_set(with_gc)
    assert {p for p in before if p not in after} == {p for p in before
                                                    if any(p == o or p.startswith(o + "/") for o in torn)}
    assert all(after[p] == before[p] for p in after) and not set(after) - set(before)
    gc_ev = json.loads(events(with_gc, "WHERE kind = 'gc'")[0]["detail"])
    assert gc_ev["removed_bytes"] == sum(torn.values()) and gc_ev["kept_adoptable"] == unlogged

    # the run adopts exactly as much after gc as without it
    assert _resume(cli, with_gc) == _resume(cli, without) == unlogged
    assert _written(with_gc) == _written(without) == {"samples": LOST_N, "max_per_sample": 1, "adopted": unlogged}
    assert sweep(with_gc).ok == LOST_N
    again = collect_garbage(with_gc)  # adopted: referenced now, nothing kept aside, nothing to remove
    assert (again.orphans.count, again.orphans.adoptable, again.removed_bytes) == (0, [], 0)


def test_gc_reclaims_durable_groups_no_run_would_adopt(rolled_back, tmp_path, cli):
    """Unlogged groups whose samples a run would not adopt (retired here; equally: done from other bytes, or of
    a fingerprint the source no longer has) are orphans: gc reclaims them."""
    build = copy_build(rolled_back, tmp_path / "b")
    lay = layout(build)
    done = _done(build)
    seg = _unlogged_segment(build)
    kept = collect_garbage(build, dry_run=True).orphans
    assert kept.count == 0 and kept.adoptable_samples == LOST_N - LOST_FIRST
    others = [f"s{i:04d}" for i in range(LOST_N) if f"s{i:04d}" not in done]
    cp = cli("skip", build, *others, "--reason", "test: never adopted")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    rep = collect_garbage(build)
    assert rep.orphans.adoptable == [] and [o.kind for o in rep.orphans.orphans] == ["segment"]
    assert rep.orphans.orphans[0].path == f"data/{seg}" and not (lay.data / seg).exists()
    assert sweep(build).ok == LOST_FIRST
