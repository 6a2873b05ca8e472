"""The data layer on real Zarr stores: chunk files hsbuild writes directly are the bytes zarr itself would write,
zarr reads them back bit-exact (bf16 special values included), and a chunk file is never written twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from builder.store.codec import from_storage, to_storage
from builder.store.reader import SegmentReader
from builder.store.segment import SegmentWriter, chunk_paths, init_data_group


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


@pytest.mark.parametrize("codec", ["zstd:1", "zstd:3", "none"])
def test_direct_chunks_equal_zarrs_own_and_read_back_bit_exact(tmp_path, codec):
    data = tmp_path / "data"
    init_data_group(data, {})
    direct = SegmentWriter(data, "seg-direct", 32, 3, 16, codec).create()
    via_zarr = SegmentWriter(data, "seg-zarr", 32, 3, 16, codec).create()
    reader = SegmentReader(data)
    for n in (5, 16, 37):  # inside one chunk, exactly one chunk, several chunks with a padded tail
        s = sample(n, seed=n)
        loc = direct.write(*s)
        start = via_zarr.cursor
        via_zarr.cursor = -(-(start + n) // 16) * 16
        via_zarr._write_zarr(start, {"input_ids": s[0], "loss_mask": s[1], "hidden_state": to_storage(s[3]),
                                     "aux_hidden_state": to_storage(s[2])})
        assert loc.token_start == start and loc.token_start % 16 == 0
        for fld in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"):
            ours = chunk_paths(direct.path, fld, loc.token_start, n, 16)
            theirs = chunk_paths(via_zarr.path, fld, start, n, 16)
            assert [p.read_bytes() for p in ours] == [p.read_bytes() for p in theirs], fld
        got = reader.read("seg-direct", loc.token_start, n)
        assert np.array_equal(got["input_ids"].numpy(), s[0]) and np.array_equal(got["loss_mask"].numpy(), s[1])
        for fld, t in (("aux_hidden_state", s[2]), ("hidden_state", s[3])):
            assert got[fld].dtype == torch.bfloat16
            assert torch.equal(got[fld].view(torch.int16), t.view(torch.int16))
    # the arrays are plain Zarr v3: any reader sees the raw bf16 bit patterns and the logical dtype
    arr = zarr.open_array(str(direct.path / "hidden_state"), mode="r")
    assert arr.attrs["logical_dtype"] == "bfloat16" and arr.dtype == np.uint16
    assert from_storage(arr[0:5], "bfloat16").view(torch.int16).tolist() == sample(5, seed=5)[3].view(
        torch.int16)[:5].tolist()


def test_a_chunk_file_is_never_written_twice(tmp_path):
    data = tmp_path / "data"
    init_data_group(data, {})
    w = SegmentWriter(data, "seg-a", 32, 3, 16, "zstd:1").create()
    loc = w.write(*sample(20))
    files = {p: p.read_bytes() for p in chunk_paths(w.path, "hidden_state", 0, 20, 16)}
    w.cursor = 0  # a buggy writer trying to go back over committed bytes
    with pytest.raises(FileExistsError):
        w.write(*sample(20, seed=9))
    assert {p: p.read_bytes() for p in files} == files
    with pytest.raises(FileExistsError):  # and a segment name is never reused
        SegmentWriter(data, "seg-a", 32, 3, 16, "zstd:1").create()
    assert loc.nbytes == sum(p.stat().st_size for f in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
                             for p in chunk_paths(w.path, f, 0, 20, 16))
