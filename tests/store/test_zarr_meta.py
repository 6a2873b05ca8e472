"""The zarr.json documents hsbuild writes without importing zarr (store/zarr_meta.py) are the ones zarr-python
writes itself for the same group and arrays (compared as zarr parses them), for every codec, fp8 builds
and other dtypes; zarr opens what hsbuild created and reads a sample back bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import zarr

from builder.store.codec import parse_codec, stored_width
from builder.store.segment import DIMS, FIELDS, SegmentWriter, init_data_group

CODECS = ["zstd:1", "zstd:-3", "blosc-lz4:5", "blosc-zstd:3", "blosc-lz4-bitshuffle:5", "blosc-zstd-bitshuffle:9",
          "none"]


def doc(path) -> dict:
    return json.loads(path.read_text())


def parsed(node_dir) -> dict:
    """The node's metadata as zarr parses it (robust to a later zarr adding keys with their defaults)."""
    return zarr.open(store=str(node_dir), mode="r").metadata.to_dict()


def zarrs_segment(root, seg: SegmentWriter) -> None:
    """The same segment as zarr-python creates it (what SegmentWriter did before it wrote the documents)."""
    fp8 = seg.quantize == "fp8"
    group = zarr.create_group(store=str(root), zarr_format=3,
                              attributes={"segment": seg.name, "hsbuild_layout": 2, "shard_chunks": seg.shard_chunks})
    store = "uint8" if fp8 else {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}[seg.dtype]
    for fld in FIELDS:
        two_d = DIMS[fld] == 2
        width = stored_width(seg.hidden_size * (seg.n_aux if fld == "aux_hidden_state" else 1), seg.quantize)
        row = (width,) if two_d else ()
        compressors = [zarr.registry.get_codec_class(c["name"]).from_dict(c)
                       for c in parse_codec(seg.codec, 1 if fp8 and two_d else 2)]
        group.create_array(name=fld, shape=(1 << 36, *row), chunks=(seg.chunk_tokens, *row),
                           shards=(seg.geometry.shard_tokens, *row),
                           dtype={"input_ids": "int32", "loss_mask": "uint8"}.get(fld, store),
                           compressors=compressors, fill_value=0,
                           chunk_key_encoding={"name": "default", "separator": "."},
                           attributes=({"logical_dtype": seg.dtype, **({"quantized": "fp8_e4m3fn_token_scale"}
                                                                      if fp8 else {})} if two_d else {}))


@pytest.mark.parametrize(("codec", "quantize", "dtype"),
                         [(c, "none", "bfloat16") for c in CODECS]
                         + [("blosc-lz4-bitshuffle:5", "fp8", "bfloat16"), ("zstd:1", "fp8", "bfloat16"),
                            ("zstd:1", "none", "float32"), ("blosc-lz4:5", "none", "float16")])
def test_segment_documents_are_zarrs_own(tmp_path, codec, quantize, dtype):
    data = tmp_path / "data"
    init_data_group(data, {"model": "m", "hidden_size": 24})
    zarr.create_group(store=str(tmp_path / "zgroup"), zarr_format=3,
                      attributes={"hsbuild_layout": 2, "model": "m", "hidden_size": 24})
    assert parsed(data) == parsed(tmp_path / "zgroup")

    seg = SegmentWriter(data, "seg-a", 24, 3, 16, codec, dtype=dtype, quantize=quantize).create()
    zarrs_segment(tmp_path / "zseg", seg)
    mine, theirs = parsed(seg.path), parsed(tmp_path / "zseg")
    assert isinstance(doc(seg.path / "zarr.json")["attributes"]["created_at"], float)
    mine["attributes"].pop("created_at")
    assert mine["attributes"]["segment"] == "seg-a"
    assert mine == theirs
    for fld in FIELDS:
        assert parsed(seg.path / fld) == parsed(tmp_path / "zseg" / fld), fld


def test_zarr_reads_a_segment_hsbuild_created(tmp_path):
    torch = pytest.importorskip("torch")
    data = tmp_path / "data"
    init_data_group(data, {})
    seg = SegmentWriter(data, "seg-a", 8, 2, 4, "zstd:1").create()
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(11, 8, generator=g).to(torch.bfloat16)
    aux = torch.randn(11, 16, generator=g).to(torch.bfloat16)
    ids = np.arange(11, dtype=np.int32) + 3
    loc = seg.write(ids, np.ones(11, dtype=np.uint8), aux, hs, sample_id="s0")
    group = zarr.open_group(str(seg.path), mode="r")
    got = group["hidden_state"][loc.token_start:loc.token_start + 11]
    assert np.array_equal(got, hs.view(torch.int16).numpy().view(np.uint16))
    got_aux = group["aux_hidden_state"][loc.token_start:loc.token_start + 11]
    assert np.array_equal(got_aux, aux.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(group["input_ids"][loc.token_start:loc.token_start + 11], ids)
    assert group.attrs["segment"] == "seg-a"


def test_the_write_path_imports_no_zarr(tmp_path):
    """Creating the data group and a segment, and encoding chunks, leaves zarr unimported (its import is about
    0.2 s of CPU at every worker's start)."""
    code = ("import sys; from pathlib import Path\n"
            "from builder.store.segment import SegmentWriter, init_data_group\n"
            f"d = Path({str(tmp_path / 'data')!r}); init_data_group(d, {{}})\n"
            "SegmentWriter(d, 'seg-a', 8, 2, 4).create()\n"
            "import builder.run.coordinator, builder.run.worker\n"
            "print(sorted(m for m in sys.modules if m == 'zarr' or m.startswith('zarr.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
