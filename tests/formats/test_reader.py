"""The trainer's reader never returns what was not written: a missing chunk file (Zarr would fill zeros) or bytes
whose CRC-32C differs from the `written` event raise a domain error naming the sample, segment, field and repair,
while the other samples still read bit-exact. Real builds, real chunk files deleted and damaged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_rows

from builder.errors import DamagedSampleError
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.store.segment import field_geometry, sample_files
from builder.store.shard import EMPTY, encode_shard, read_index

C = 16  # chunk length: the samples below span several chunks


def _built(make_build, codec: str) -> tuple:
    build = make_build(rows=random_rows(4, seed=5, lo=2 * C + 3, hi=3 * C), codec=codec, chunk_tokens=C)
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 4
    with EventLog(layout(build).events, read_only=True) as log:
        rows = {r["sample_id"]: r for r in log.samples()}
    return build, rows


def _inner(build, row, fld, j):
    """(shard file, its index, position in it) of the sample's j-th chunk of `fld`."""
    seg = layout(build).data / row["segment"]
    inner, shard_chunks = field_geometry(seg, fld)
    k = row["token_start"] // inner + j
    path = next(p for p in sample_files(seg, fld, row["token_start"], row["num_tokens"])
                if p.name.split(".")[1] == str(k // shard_chunks))
    return path, read_index(path, shard_chunks), k % shard_chunks


def drop_chunk(build, row, fld, j):
    """Rewrite the shard as if the sample's j-th chunk had never been written: a consistent shard that zarr
    reads as zeros there."""
    path, idx, pos = _inner(build, row, fld, j)
    data = path.read_bytes()
    chunks = [None if o == EMPTY or i == pos else data[o : o + n] for i, (o, n) in enumerate(idx.tolist())]
    path.write_bytes(encode_shard(chunks))
    return path


def garble_chunk(build, row, fld, j) -> None:
    """Overwrite the bytes of the sample's j-th chunk (same length): present, but they do not decode."""
    path, idx, pos = _inner(build, row, fld, j)
    o, n = idx[pos].tolist()
    data = bytearray(path.read_bytes())
    data[o : o + n] = b"\xff" * n
    path.write_bytes(bytes(data))


def _items(ds) -> dict[str, dict]:
    """Copies: an uncompressed build's items are views of its (write-once) shard files, as torch.load(mmap=True)
    gives, and the tests below rewrite a shard in place."""
    return {ds.index[i]["sample_id"]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ds[i].items()}
            for i in range(len(ds))}


def test_missing_or_undecodable_chunk_raises_naming_the_sample(make_build):
    build, rows = _built(make_build, "zstd:1")
    good = _items(HiddenStateDataset(build))
    drop_chunk(build, rows["s0001"], "hidden_state", 1)  # zarr alone would read zeros there
    garble_chunk(build, rows["s0002"], "aux_hidden_state", 0)

    for verify in (True, False):  # presence is checked even without checksums
        ds = HiddenStateDataset(build, verify_checksums=verify)
        pos = ds.by_id()
        with pytest.raises(DamagedSampleError) as ei:
            ds[pos["s0001"]]
        e = ei.value
        assert isinstance(e, OSError) and (e.reason, e.sample_id, e.field) == ("missing_data", "s0001", "hidden_state")
        msg = str(e)
        seg = rows["s0001"]["segment"]
        assert "s0001" in msg and seg in msg and "hidden_state/c." in msg and "lacks chunk" in msg
        assert f"hsbuild verify {build}" in msg and f"hsbuild resume {build}" in msg
        with pytest.raises(DamagedSampleError, match="s0002.*aux_hidden_state.*do not decode") as ei:
            ds[pos["s0002"]]
        assert ei.value.reason == "unreadable"
        for sid in ("s0000", "s0003"):  # the others still read, bit-exact
            item = ds[pos[sid]]
            assert torch.equal(item["hidden_state"].view(torch.int16), good[sid]["hidden_state"].view(torch.int16))
            assert torch.equal(item["input_ids"], good[sid]["input_ids"])


def test_flipped_byte_raises_checksum_mismatch_unless_opted_out(make_build):
    build, rows = _built(make_build, "none")  # uncompressed chunks: a flipped byte still "decodes"
    good = _items(HiddenStateDataset(build))
    chunk, idx, pos = _inner(build, rows["s0002"], "hidden_state", 0)
    data = bytearray(chunk.read_bytes())
    data[int(idx[pos][0]) + 10] ^= 0x40  # inside the sample's first token row
    chunk.write_bytes(bytes(data))

    ds = HiddenStateDataset(build)
    with pytest.raises(DamagedSampleError) as ei:
        ds[ds.by_id()["s0002"]]
    e = ei.value
    assert (e.reason, e.sample_id, e.segment, e.field) == ("checksum_mismatch", "s0002", rows["s0002"]["segment"],
                                                           "hidden_state")
    want = json.loads(rows["s0002"]["checksums"])["hidden_state"]
    assert "checksum mismatch" in str(e) and want in str(e) and "hsbuild resume" in str(e)
    for sid in ("s0000", "s0001", "s0003"):
        item = ds[ds.by_id()[sid]]
        assert torch.equal(item["aux_hidden_state"].view(torch.int16), good[sid]["aux_hidden_state"].view(torch.int16))

    fast = HiddenStateDataset(build, verify_checksums=False)  # the opt-out returns the stored bytes as they are
    got = fast[fast.by_id()["s0002"]]["hidden_state"].view(torch.int16).numpy()
    diff = got != good["s0002"]["hidden_state"].view(torch.int16).numpy()
    assert diff.sum() == 1 and np.argwhere(diff)[0].tolist() == [0, 5]
