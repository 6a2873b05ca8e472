"""A group's barrier (docs/design.md section 5, step 6): the manifest is created only once every shard file of
the group and their directories are durable, so a crash can never keep a manifest that vouches for lost bytes."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from builder.store.segment import FIELDS, MANIFEST_DIR, SegmentWriter, init_data_group, sample_files


def test_a_manifest_is_created_only_once_its_shards_are_durable(tmp_path, monkeypatch):
    """The system calls of one group's barrier, in the order they returned: the manifest is created after every
    shard file of the group and every shard directory was fsynced, and its own directory fsynced after it.
    (Before: all written and fsynced at once, then the directories: a crash could keep a manifest whose shards
    were lost.)"""
    data = tmp_path / "data"
    init_data_group(data, {})
    w = SegmentWriter(data, "seg-0123abcd-w00-abcdef", hidden_size=16, n_aux=3, chunk_tokens=16).create()
    for i, n in enumerate((20, 7)):
        w.add(np.arange(n, dtype=np.int32), np.ones(n, np.uint8), torch.randn(n, 48).to(torch.bfloat16),
              torch.randn(n, 16).to(torch.bfloat16), sample_id=f"s{i}", fingerprint="f", attempt=1)
    ops: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_open, real_fsync = os.open, os.fsync

    def spy_open(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            with lock:
                ops.append(("create", str(path)))
        return real_open(path, flags, *a, **kw)

    def spy_fsync(fd):
        real_fsync(fd)
        with lock:
            ops.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    locs = w.flush()
    monkeypatch.undo()
    seg = w.path
    manifest = seg / MANIFEST_DIR / "0.json"
    shards = sorted({p for loc in locs for f in FIELDS
                     for p in sample_files(seg, f, loc.token_start, loc.num_tokens)})
    assert len(shards) == 4 and all(p.is_file() for p in shards)
    at = {op: i for i, op in enumerate(ops)}
    created = at[("create", str(manifest))]
    for p in [*shards, *{p.parent for p in shards}]:
        assert at[("fsync", str(p))] < created, (p, ops)
    assert at[("fsync", str(manifest))] < at[("fsync", str(seg / MANIFEST_DIR))]
