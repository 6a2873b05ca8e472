"""The data layer on real Zarr stores: shard files hsbuild writes directly are the bytes zarr itself would write,
zarr reads them back bit-exact (bf16 special values included), a group is a few files with a manifest, and a
shard file is never written twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from builder.store.codec import from_storage, to_storage
from builder.store.reader import SegmentReader
from builder.store.segment import FIELDS, SegmentWriter, init_data_group, read_manifests, sample_files
from builder.store.shard import EMPTY, read_index


def sample(n: int, hidden: int = 32, n_aux: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, n_aux * hidden, generator=g).to(torch.bfloat16)
    final = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
    # bf16 values whose bit patterns a float conversion would not keep: NaN payloads, -0.0, inf, subnormals
    special = torch.from_numpy(np.array([0x7FC1, 0xFFC3, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F], dtype=np.uint16).view(np.int16))
    final.view(torch.int16)[0, : len(special)] = special
    ids = np.arange(n, dtype=np.int32) * 7 % 1000
    mask = (np.arange(n) % 3 > 0).astype(np.uint8)
    return ids, mask, aux, final


def same_shard(mine, zarrs, shard_chunks: int) -> bool:
    """Every inner chunk zarr wrote is byte-identical in ours; ours may also hold a chunk that is all fill value
    (zarr leaves those out of a shard)."""
    a, b = read_index(mine, shard_chunks), read_index(zarrs, shard_chunks)
    da, db = mine.read_bytes(), zarrs.read_bytes()
    for (oa, na), (ob, nb) in zip(a.tolist(), b.tolist(), strict=True):
        if ob == EMPTY:
            continue
        if oa == EMPTY or da[oa : oa + na] != db[ob : ob + nb]:
            return False
    return True


@pytest.mark.parametrize("codec", ["zstd:1", "zstd:3", "none", "blosc-lz4:5", "blosc-lz4-bitshuffle:5", "blosc-zstd-bitshuffle:3"])
def test_shards_equal_zarrs_own_and_read_back_bit_exact(tmp_path, codec):
    """A group written directly is, shard file for shard file, what zarr writes for the same data, and reads
    back bit-exact through zarr."""
    data = tmp_path / "data"
    init_data_group(data, {})
    direct = SegmentWriter(data, "seg-direct", 32, 3, 16, codec, shard_chunks=4).create()
    via_zarr = SegmentWriter(data, "seg-zarr", 32, 3, 16, codec, shard_chunks=4).create()
    reader = SegmentReader(data)
    for group in ((5,), (16, 37), (3, 70, 1)):  # one chunk; a full chunk + a padded tail; a group over shards
        samples = [sample(n, seed=n) for n in group]
        locs = [direct.add(*s, sample_id=f"n{len(s[0])}") for s in samples]
        assert direct.flush() == locs
        lo, hi = locs[0].token_start, locs[-1].token_start + locs[-1].num_tokens
        for fld, pick in (("input_ids", lambda s: s[0]), ("loss_mask", lambda s: s[1]),
                          ("hidden_state", lambda s: to_storage(s[3])), ("aux_hidden_state", lambda s: to_storage(s[2]))):
            arr = zarr.open_array(str(via_zarr.path / fld), mode="r+", config={"write_empty_chunks": True})
            block = np.zeros((hi - lo, *arr.shape[1:]), dtype=arr.dtype)  # the group as one write, padding zero
            for loc, s in zip(locs, samples, strict=True):
                block[loc.token_start - lo : loc.token_start - lo + loc.num_tokens] = pick(s)
            arr[lo:hi] = block
            ours = [p for loc in locs for p in sample_files(direct.path, fld, loc.token_start, loc.num_tokens)]
            theirs = [p for loc in locs for p in sample_files(via_zarr.path, fld, loc.token_start, loc.num_tokens)]
            for mine, zarrs in zip(ours, theirs, strict=True):
                assert same_shard(mine, zarrs, 4), (fld, group, mine.name)
        for loc, s in zip(locs, samples, strict=True):
            assert loc.token_start % 16 == 0
            got = reader.read("seg-direct", loc.token_start, loc.num_tokens)
            assert np.array_equal(got["input_ids"].numpy(), s[0]) and np.array_equal(got["loss_mask"].numpy(), s[1])
            for fld, t in (("aux_hidden_state", s[2]), ("hidden_state", s[3])):
                assert got[fld].dtype == torch.bfloat16
                assert torch.equal(got[fld].view(torch.int16), t.view(torch.int16))
    # the arrays are plain Zarr v3: any reader sees the raw bf16 bit patterns and the logical dtype
    arr = zarr.open_array(str(direct.path / "hidden_state"), mode="r")
    assert arr.attrs["logical_dtype"] == "bfloat16" and arr.dtype == np.uint16
    assert from_storage(arr[0:5], "bfloat16").view(torch.int16).tolist() == sample(5, seed=5)[3].view(
        torch.int16)[:5].tolist()


def test_a_group_makes_few_files_and_describes_itself(tmp_path):
    data = tmp_path / "data"
    init_data_group(data, {})
    w = SegmentWriter(data, "seg-a", 32, 3, 16, "zstd:1").create()
    for i in range(50):
        w.add(*sample(4, seed=i), sample_id=f"s{i}", fingerprint=f"f{i}", attempt=1)
    locs = w.flush()
    assert len(locs) == 50
    shard_files = [p for f in FIELDS for p in (w.path / f).iterdir() if p.name.startswith("c")]
    assert len(shard_files) == 4  # one shard file per field for the whole group
    (m,) = read_manifests(w.path)
    assert [s["sample_id"] for s in m["samples"]] == [f"s{i}" for i in range(50)]
    assert m["samples"][7]["token_start"] == locs[7].token_start and m["samples"][7]["checksums"] == locs[7].checksums


def test_a_shard_file_is_never_written_twice(tmp_path):
    data = tmp_path / "data"
    init_data_group(data, {})
    w = SegmentWriter(data, "seg-a", 32, 3, 16, "zstd:1").create()
    w.write(*sample(20))
    files = {p: p.read_bytes() for f in FIELDS for p in sample_files(w.path, f, 0, 20)}
    assert w.cursor % w.geometry.shard_tokens == 0  # the next group starts on a fresh shard
    w.cursor = w._group_start = 0  # a buggy writer trying to go back over committed bytes
    with pytest.raises(FileExistsError):
        w.write(*sample(20, seed=9))
    assert {p: p.read_bytes() for p in files} == files
    with pytest.raises(FileExistsError):  # and a segment name is never reused
        SegmentWriter(data, "seg-a", 32, 3, 16, "zstd:1").create()
