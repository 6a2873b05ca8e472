"""The reader's single pieces: the one `zarr.json` parser (`zarr_meta.read_array_meta`) says of an array what
zarr says, for the documents hsbuild writes and for zarr's own, sharded or not; the one dtype table agrees with
numpy and torch; the one shard-index check (`shard.read_index`, and `damage.shard_rows` over it) refuses a
truncated, extended or corrupted index and names the absent chunk a sample needs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zarr
from test_zarr_meta import zarrs_segment

from builder.errors import DamagedSampleError
from builder.store.damage import MISSING, UNREADABLE, shard_rows
from builder.store.direct import FieldLayout
from builder.store.dtypes import STATE_DTYPES, STORAGE_DTYPES, itemsize, numpy_dtype, torch_dtype
from builder.store.segment import FIELDS, SegmentWriter, init_data_group
from builder.store.shard import ShardIndexError, encode_shard, read_index
from builder.store.zarr_meta import read_array_meta


@pytest.mark.parametrize(("codec", "quantize", "dtype"), [("zstd:1", "none", "bfloat16"), ("none", "none", "float32"),
                                                           ("blosc-lz4:5", "fp8", "bfloat16")])
def test_the_parser_reads_what_zarr_reads(tmp_path, codec, quantize, dtype):
    data = tmp_path / "data"
    init_data_group(data, {})
    seg = SegmentWriter(data, "seg-a", 24, 3, 16, codec, dtype=dtype, quantize=quantize).create()
    zarrs_segment(tmp_path / "zseg", seg)
    for root in (seg.path, tmp_path / "zseg"):
        for fld in FIELDS:
            meta, arr = read_array_meta(root / fld), zarr.open_array(store=str(root / fld), mode="r")
            assert meta.shape == arr.shape and meta.chunk_shape == arr.chunks, fld
            assert (meta.chunk_tokens * meta.shard_chunks,) == arr.shards[:1], fld
            assert meta.dtype == arr.dtype and meta.attributes == dict(arr.attrs), fld
            assert meta.index_location == "end" and FieldLayout.from_meta(meta) is not None, fld


def test_the_parser_reads_an_unsharded_array(tmp_path):
    arr = zarr.create_array(store=str(tmp_path / "a"), shape=(100, 6), chunks=(8, 6), dtype="uint16",
                            attributes={"logical_dtype": "bfloat16"})
    meta = read_array_meta(tmp_path / "a")
    assert (meta.shape, meta.chunk_shape, meta.shard_chunks, meta.index_location) == (arr.shape, arr.chunks, 0, None)
    assert meta.logical_dtype == "bfloat16" and meta.quantized is None and FieldLayout.from_meta(meta) is None


@pytest.mark.parametrize("bad", ["[]", "{}", '{"shape": [4], "data_type": "int32"}',
                                 '{"shape": [4], "data_type": "int32", "chunk_grid": {"configuration": '
                                 '{"chunk_shape": [4]}}, "codecs": [7]}',
                                 '{"shape": [4], "data_type": "int32", "chunk_grid": {"configuration": '
                                 '{"chunk_shape": [4]}}, "attributes": [1]}', "not json"])
def test_the_parser_refuses_what_is_no_array(tmp_path, bad):
    (tmp_path / "zarr.json").write_text(bad)
    with pytest.raises((ValueError, KeyError, IndexError, TypeError)):
        read_array_meta(tmp_path)


def test_the_dtype_table_agrees_with_numpy_and_torch():
    torch = pytest.importorskip("torch")
    assert STORAGE_DTYPES == {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}
    for name in STATE_DTYPES:
        assert itemsize(name) == torch_dtype(name).itemsize == numpy_dtype(STORAGE_DTYPES[name]).itemsize
    assert torch_dtype("bfloat16") is torch.bfloat16 and numpy_dtype("bfloat16") == np.dtype("<u2")
    assert itemsize("complex128", default=8) == 8 and numpy_dtype("int16") == np.dtype("<i2")


def test_the_shard_index_check(tmp_path):
    chunks = [b"a" * 5, None, b"b" * 7, b"c" * 3]
    good = tmp_path / "c.3"
    good.write_bytes(encode_shard(chunks))
    idx = read_index(good, 4)
    fd = os.open(good, os.O_RDONLY)
    try:
        assert np.array_equal(read_index(fd, 4), idx)
        assert shard_rows(fd, good.relative_to(tmp_path), "seg", "input_ids", 3, 4, 2, 3).tolist() == [[5, 7], [12, 3]]
        with pytest.raises(DamagedSampleError) as ei:
            shard_rows(fd, good.relative_to(tmp_path), "seg", "input_ids", 3, 4, 0, 3)
        assert ei.value.reason == MISSING and "c.3 lacks chunk 13 of the sample" in ei.value.problem
    finally:
        os.close(fd)

    data = good.read_bytes()
    for name, damaged, says in [("short", data[:10], "shorter than its index"),
                                ("crc", data[:-1] + bytes([data[-1] ^ 1]), "crc32c"),
                                ("appended", b"x" + data, "accounts for"),
                                ("cut", data[1:], "accounts for")]:
        path = tmp_path / name
        path.write_bytes(damaged)
        with pytest.raises(ShardIndexError, match=says):
            read_index(path, 4)
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(DamagedSampleError) as ei:
                shard_rows(fd, path.relative_to(tmp_path), "seg", "input_ids", 0, 4, 0, 0)
            assert ei.value.reason == UNREADABLE and says in ei.value.problem
        finally:
            os.close(fd)
