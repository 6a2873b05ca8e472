"""Zarr v3 shards, written directly: many chunks of a group of samples in one write-once file.

A segment's arrays use zarr's `sharding_indexed` codec along the token axis. A shard file holds `shard_chunks`
inner chunks of `chunk_tokens` tokens each: the encoded inner chunks one after another, then the index
(`shard_chunks` pairs of little-endian uint64 offset and length; an absent chunk is (2^64-1, 2^64-1)), then
the crc32c of the index (little-endian uint32), exactly as zarr's `[bytes, crc32c]` index codecs write it, so
zarr reads these files as its own. Chunk keys use the `.` separator (`c.7` and `c.7.0`): no directory per
chunk row, every shard of a field lies in the field's own directory.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

EMPTY = (1 << 64) - 1
INDEX_ENTRY = 16  # two uint64 per inner chunk
CRC_BYTES = 4


class ShardIndexError(ValueError):
    """A shard file's index is truncated or fails its crc32c."""


@dataclass(frozen=True)
class ShardGeometry:
    chunk_tokens: int
    shard_chunks: int

    @property
    def shard_tokens(self) -> int:
        return self.chunk_tokens * self.shard_chunks

    @property
    def index_bytes(self) -> int:
        return index_bytes(self.shard_chunks)

    def shards(self, token_start: int, num_tokens: int) -> range:
        """Indices of the shards holding tokens [token_start, token_start + num_tokens)."""
        first = token_start // self.shard_tokens
        last = (token_start + max(num_tokens, 1) - 1) // self.shard_tokens
        return range(first, last + 1)

    def next_shard_start(self, token: int) -> int:
        """The first token of the shard after the one holding `token - 1` (where a new group starts)."""
        return -(-token // self.shard_tokens) * self.shard_tokens


def shard_key(fld_dims: int, index: int) -> str:
    return f"c.{index}" if fld_dims == 1 else f"c.{index}.0"


def shard_path(seg_dir: Path, fld: str, fld_dims: int, index: int) -> Path:
    return seg_dir / fld / shard_key(fld_dims, index)


def shard_parts(chunks: list[bytes | None]) -> list[bytes]:
    """A shard file from its encoded inner chunks (None: absent), as the buffers to write one after another
    (the present chunks, then the index and its CRC-32C): written with one gather write, never copied into one."""
    parts: list[bytes] = []
    offset = 0
    index = np.full((len(chunks), 2), EMPTY, dtype="<u8")
    for i, c in enumerate(chunks):
        if c is None:
            continue
        index[i] = (offset, len(c))
        offset += len(c)
        parts.append(c)
    raw_index = index.tobytes()
    return [*parts, raw_index + struct.pack("<I", crc32c.crc32c(raw_index))]


def encode_shard(chunks: list[bytes | None]) -> bytes:
    """A shard file from its encoded inner chunks (None: absent), index at the end, as one bytes."""
    return b"".join(shard_parts(chunks))


def index_bytes(shard_chunks: int) -> int:
    """The size of a shard file's index: its (offset, length) pairs and their CRC-32C."""
    return shard_chunks * INDEX_ENTRY + CRC_BYTES


def decode_index(tail: bytes, shard_chunks: int) -> np.ndarray:
    """The (offset, length) pairs from a shard's last `index_bytes` bytes; raises ShardIndexError."""
    want = index_bytes(shard_chunks)
    if len(tail) != want:
        raise ShardIndexError(f"index is {len(tail)} bytes, expected {want}")
    raw, crc = tail[:-CRC_BYTES], struct.unpack("<I", tail[-CRC_BYTES:])[0]
    if crc32c.crc32c(raw) != crc:
        raise ShardIndexError("index fails its crc32c")
    return np.frombuffer(raw, dtype="<u8").reshape(shard_chunks, 2)


def read_index(shard: Path | int, shard_chunks: int) -> np.ndarray:
    """Read and check a shard file's index, the file given by its path or as an open descriptor (raises OSError,
    ShardIndexError): the file holds the index whole, the index passes its CRC-32C, and it accounts for exactly
    the file's chunk bytes. The one check of a shard's index: every reader, check and tool reads it here."""
    if not isinstance(shard, int):
        fd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return read_index(fd, shard_chunks)
        finally:
            os.close(fd)
    want = index_bytes(shard_chunks)
    size = os.fstat(shard).st_size
    if size < want:
        raise ShardIndexError(f"file is {size} bytes, shorter than its index ({want})")
    idx = decode_index(os.pread(shard, want, size - want), shard_chunks)
    body = size - want
    present = idx[:, 0] != EMPTY
    end = int((idx[present, 0] + idx[present, 1]).max()) if present.any() else 0
    if end != body:  # written whole and once: the chunk data is exactly what the index accounts for
        raise ShardIndexError(f"holds {body} bytes of chunk data, its index accounts for {end} (truncated, "
                              "appended to or rewritten)")
    return idx
