"""Orphans and `hsbuild gc`: what crashed writers leave is reported as reclaimable, and gc removes exactly it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from verify_helpers import N_SAMPLES, copy_build, events, file_set, live, shared_template, sweep

from builder.config import load_config
from builder.errors import BuildLockedError
from builder.layout import layout
from builder.log.lock import BuildLock
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
