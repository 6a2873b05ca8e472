"""Zarr v3 metadata documents (`zarr.json`) for what hsbuild writes: a group, and an array sharded along its
first axis.

They are spelled out from the Zarr v3 specification as zarr-python 3 writes them (tests/store/test_zarr_meta.py
compares them with zarr's own, as zarr parses both), so the write path needs no zarr import: `init` and every
worker creating a segment save about 0.2 s of CPU each, at a run's CPU-bound start. Shard files and chunks are
written the same way (shard.py, codec.chunk_encoder); zarr reads all of it as its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ZARR_JSON = "zarr.json"
# a shard's index: (offset, length) uint64 pairs, little-endian, then their crc32c (shard.py writes it)
SHARD_INDEX_CODECS = ({"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"})


def group_doc(attributes: dict) -> dict:
    return {"attributes": attributes, "zarr_format": 3, "node_type": "group"}


def bytes_codec(dtype: str) -> dict:
    """The array -> bytes codec: little-endian; a one-byte type has no endianness to state."""
    if np.dtype(dtype).itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def sharded_array_doc(shape: tuple[int, ...], chunk_shape: tuple[int, ...], shard_shape: tuple[int, ...],
                      dtype: str, compressors: list[dict], attributes: dict,
                      fill_value: int = 0, separator: str = ".") -> dict:
    """An array of `shape` stored in shard files of `shard_shape`, each holding inner chunks of `chunk_shape`
    encoded with [bytes, *compressors], its index at the end; chunk keys `c<sep>i<sep>j`."""
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": fill_value,
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunk_shape),
            "codecs": [bytes_codec(dtype), *compressors],
            "index_codecs": [dict(c) for c in SHARD_INDEX_CODECS],
            "index_location": "end",
        }}],
        "attributes": attributes,
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def encode(doc: dict) -> bytes:
    return json.dumps(doc, indent=2).encode()


def create_doc(directory: Path, doc: dict) -> Path:
    """Write `directory/zarr.json`, which must not exist yet (FileExistsError, nothing touched). Not fsynced:
    the caller makes the node durable together with the rest of what it creates."""
    path = Path(directory) / ZARR_JSON
    with path.open("xb") as f:  # O_EXCL; a buffered write is whole
        f.write(encode(doc))
    return path
