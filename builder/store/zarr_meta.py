"""Zarr v3 metadata documents (`zarr.json`) for what hsbuild writes: a group, and an array sharded along its
first axis; and the one parser of an array's document (`read_array_meta`) that every reader and check uses.

They are spelled out from the Zarr v3 specification as zarr-python 3 writes them (tests/store/test_zarr_meta.py
compares them with zarr's own, as zarr parses both), so the write path needs no zarr import: `init` and every
worker creating a segment save about 0.2 s of CPU each, at a run's CPU-bound start. Shard files and chunks are
written the same way (shard.py, codec.chunk_encoder); zarr reads all of it as its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from builder.store.dtypes import numpy_dtype

ZARR_JSON = "zarr.json"
# a shard's index: (offset, length) uint64 pairs, little-endian, then their crc32c (shard.py writes it)
SHARD_INDEX_CODECS = ({"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"})


def group_doc(attributes: dict) -> dict:
    return {"attributes": attributes, "zarr_format": 3, "node_type": "group"}


def bytes_codec(dtype: str) -> dict:
    """The array -> bytes codec: little-endian; a one-byte type has no endianness to state."""
    if numpy_dtype(dtype).itemsize == 1:
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


@dataclass(frozen=True)
class ArrayMeta:
    """What an array's zarr.json says about how its values lie on disk (the parts hsbuild reads)."""

    shape: tuple[int, ...]
    data_type: str  # the Zarr data_type (store.dtypes: bfloat16 states are uint16 here, `logical_dtype` says so)
    chunk_shape: tuple[int, ...]  # one chunk's shape: the inner chunk of a sharded array
    shard_chunks: int  # inner chunks per shard file along the first axis; 0: not sharded (a file per chunk)
    codecs: tuple[dict, ...]  # a chunk's codecs ([bytes, *compressors]): the sharding codec's inner ones
    index_location: str | None  # where a shard's index lies ("end", "start"); None: not sharded
    attributes: dict = field(default_factory=dict)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_shape[0]

    @property
    def dtype(self) -> np.dtype:
        """The stored values' (little-endian) numpy dtype."""
        return numpy_dtype(self.data_type)

    @property
    def logical_dtype(self) -> str | None:
        """The dtype the values are read as when it differs from the stored one (bfloat16 stored as uint16)."""
        return self.attributes.get("logical_dtype")

    @property
    def quantized(self) -> str | None:
        """How the values were quantized (codec.FP8_SCHEME); None: stored exactly."""
        return self.attributes.get("quantized")


def parse_array_doc(doc: object) -> ArrayMeta:
    """An array's zarr.json document, parsed; ValueError, KeyError, IndexError or TypeError when it is not one."""
    if not isinstance(doc, dict):
        raise TypeError(f"an array's metadata is a JSON object, not {type(doc).__name__}")
    try:
        grid = tuple(int(n) for n in doc["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = tuple(doc.get("codecs") or ())
        attrs = doc.get("attributes") or {}
        if not isinstance(attrs, dict):
            raise TypeError(f"attributes: a JSON object, not {type(attrs).__name__}")
        shape, data_type = tuple(int(n) for n in doc["shape"]), str(doc["data_type"])
        if codecs and codecs[0].get("name") == "sharding_indexed":
            cfg = codecs[0]["configuration"]
            inner = tuple(int(n) for n in cfg["chunk_shape"])
            return ArrayMeta(shape, data_type, inner, grid[0] // inner[0], tuple(cfg.get("codecs") or ()),
                             str(cfg.get("index_location", "end")), attrs)
        return ArrayMeta(shape, data_type, grid, 0, codecs, None, attrs)
    except AttributeError as e:  # a part that should be a JSON object is not
        raise TypeError(str(e)) from e
    except ZeroDivisionError as e:
        raise ValueError("a chunk of no tokens") from e


def read_array_meta(directory: Path) -> ArrayMeta:
    """Parse `directory/zarr.json`: raises OSError when it cannot be read; ValueError, KeyError, IndexError or
    TypeError when it is no array's metadata."""
    return parse_array_doc(json.loads((Path(directory) / ZARR_JSON).read_bytes()))
