"""Reading samples back and checking them against the checksums recorded in their `written` events.

Two levels, like restic's `check` and `check --read-data`:

- structural (`check_files`): the segment's metadata files and every chunk file the sample needs exist, none is
  empty, and (quick mode) each has a plausible size and together they hold exactly the bytes the `written`
  event recorded. Zarr silently returns fill values for a missing chunk, so absence is checked, never inferred.
- full (`check_sample`): the above, then a read back through Zarr and a crc32c of each field's uncompressed
  bytes, compared with the `written` event's checksums.

Each returns a `Finding` (reason, message) or None; reasons are those `plan.DAMAGE_REASONS` re-extracts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from builder.store.reader import SegmentReader
from builder.store.segment import DIMS, FIELDS, chunk_paths_v1
from builder.store.shard import EMPTY, ShardGeometry, ShardIndexError, read_index, shard_path

Finding = tuple[str, str]  # (reason, message)

MISSING, UNREADABLE, MISMATCH = "missing_data", "unreadable", "checksum_mismatch"
WINDOW_BYTES = 16 << 20  # uncompressed bytes per Zarr read while checksumming
ITEMSIZES = {"int32": 4, "uint8": 1, "uint16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class FieldSpec:
    """What a field's zarr.json says about its chunks (inner chunks, for a sharded field)."""

    chunk_tokens: int
    width: int  # elements per token (1 for 1-D fields)
    itemsize: int
    shard_chunks: int = 0  # inner chunks per shard file; 0: not sharded (layout 1, one file per chunk)

    @property
    def raw_chunk_bytes(self) -> int:
        return self.chunk_tokens * self.width * self.itemsize

    @property
    def max_chunk_bytes(self) -> int:
        """A generous bound on one compressed chunk file (zstd/blosc worst case is raw + a small fraction)."""
        raw = self.raw_chunk_bytes
        return raw + raw // 16 + 4096


def metadata_paths(seg_dir: Path) -> list[Path]:
    return [seg_dir / "zarr.json"] + [seg_dir / f / "zarr.json" for f in FIELDS]


def field_specs(seg_dir: Path) -> dict[str, FieldSpec] | None:
    """Chunk geometry of a segment's fields from their zarr.json, or None when any is missing or malformed."""
    specs = {}
    for fld in FIELDS:
        try:
            meta = json.loads((seg_dir / fld / "zarr.json").read_bytes())
            shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
            codecs = meta.get("codecs") or []
            shard_chunks = 0
            if codecs and codecs[0].get("name") == "sharding_indexed":
                inner = codecs[0]["configuration"]["chunk_shape"]
                shard_chunks = int(shape[0]) // int(inner[0])
                shape = inner
            specs[fld] = FieldSpec(int(shape[0]), int(shape[1]) if len(shape) > 1 else 1,
                                   ITEMSIZES.get(str(meta["data_type"]), 8), shard_chunks)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    return specs


def segment_chunk_tokens(seg_dir: Path) -> int | None:
    specs = field_specs(seg_dir)
    return specs["input_ids"].chunk_tokens if specs else None


@dataclass
class SampleCheck:
    """The outcome of checking one sample: a finding (None when good) and what it cost."""

    finding: Finding | None
    file_bytes: int = 0  # compressed bytes of its chunk files (read in a full check)
    raw_bytes: int = 0  # uncompressed bytes checksummed

    @property
    def ok(self) -> bool:
        return self.finding is None


def field_checksum(arr, token_start: int, num_tokens: int, window_bytes: int = WINDOW_BYTES) -> tuple[str, int]:
    """`store.checksum` of a sample's field, read through Zarr a window of whole chunks at a time (memory stays
    bounded however long the sample). Returns (checksum, uncompressed bytes)."""
    chunk = int(arr.chunks[0])
    row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
    step = chunk * max(1, window_bytes // max(chunk * row_bytes, 1))
    crc, nbytes, end = 0, 0, token_start + num_tokens
    for a in range(token_start, end, step):
        block = np.ascontiguousarray(arr[a : min(a + step, end)])
        crc = crc32c.crc32c(block.data, crc)
        nbytes += block.nbytes
    return f"crc32c:{crc:08x}", nbytes


def check_files(data_root: Path, segment: str, token_start: int, num_tokens: int, chunk_tokens: int,
                nbytes: int | None = None, quick: bool = False,
                specs: dict[str, FieldSpec] | None = None) -> SampleCheck:
    """Structural check of one sample, reading no data. `quick` adds the size plausibility checks (`specs`:
    the segment's field geometry when the caller has it cached)."""
    seg = data_root / segment
    if not seg.is_dir():
        return SampleCheck((MISSING, f"segment {segment} is gone"))
    for p in metadata_paths(seg):
        if not p.is_file():
            return SampleCheck((MISSING, f"metadata file {p.relative_to(data_root)} is gone"))
    if specs is None:
        specs = field_specs(seg)
    if specs is None:
        return SampleCheck((UNREADABLE, f"segment {segment}: array metadata (zarr.json) is malformed"))
    total = 0
    for fld in FIELDS:
        spec = specs[fld]
        if spec.shard_chunks:
            found = _sharded_bytes(data_root, seg, fld, spec, token_start, num_tokens)
        else:
            found = _chunk_file_bytes(data_root, seg, fld, spec, token_start, num_tokens, chunk_tokens, quick)
        if isinstance(found, tuple):
            return SampleCheck(found, total)
        total += found
    if quick and nbytes is not None and total != nbytes:
        return SampleCheck((UNREADABLE, f"chunk files hold {total} bytes, the written event recorded {nbytes} "
                                        "(truncated or rewritten)"), total)
    return SampleCheck(None, total)


def _chunk_file_bytes(data_root: Path, seg: Path, fld: str, spec: FieldSpec, token_start: int, num_tokens: int,
                      chunk_tokens: int, quick: bool) -> int | Finding:
    """Layout 1: the sizes of the sample's own chunk files."""
    total = 0
    for p in chunk_paths_v1(seg, fld, token_start, num_tokens, chunk_tokens):
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return (MISSING, f"chunk file {p.relative_to(data_root)} is gone")
        if size == 0:
            return (UNREADABLE, f"chunk file {p.relative_to(data_root)} is empty")
        if quick and size > spec.max_chunk_bytes:
            return (UNREADABLE, f"chunk file {p.relative_to(data_root)} holds {size} bytes, more than a chunk can "
                                f"({spec.max_chunk_bytes})")
        total += size
    return total


def _sharded_bytes(data_root: Path, seg: Path, fld: str, spec: FieldSpec, token_start: int,
                   num_tokens: int) -> int | Finding:
    """Layout 2: every shard file holding the sample exists, its index passes its crc32c, and lists each of
    the sample's inner chunks; returns the bytes of those inner chunks."""
    geo = ShardGeometry(spec.chunk_tokens, spec.shard_chunks)
    first = token_start // spec.chunk_tokens
    last = (token_start + max(num_tokens, 1) - 1) // spec.chunk_tokens
    total = 0
    for s in geo.shards(token_start, num_tokens):
        p = shard_path(seg, fld, DIMS[fld], s)
        try:
            idx = read_index(p, spec.shard_chunks)
        except FileNotFoundError:
            return (MISSING, f"shard file {p.relative_to(data_root)} is gone")
        except ShardIndexError as e:
            return (UNREADABLE, f"shard file {p.relative_to(data_root)}: {e}")
        lo, hi = max(first, s * spec.shard_chunks), min(last, (s + 1) * spec.shard_chunks - 1)
        rows = idx[lo - s * spec.shard_chunks : hi - s * spec.shard_chunks + 1]
        if (rows[:, 0] == EMPTY).any():
            k = lo + int(np.argmax(rows[:, 0] == EMPTY))
            return (MISSING, f"shard file {p.relative_to(data_root)} lacks chunk {k} of the sample")
        if int(rows[:, 1].max()) > spec.max_chunk_bytes:
            return (UNREADABLE, f"shard file {p.relative_to(data_root)} lists a chunk larger than a chunk can be")
        total += int(rows[:, 1].sum())
    return total


def check_sample(data_root: Path, segment: str, token_start: int, num_tokens: int, checksums: dict | str,
                 chunk_tokens: int, reader: SegmentReader | None = None) -> SampleCheck:
    """Full check of one sample: presence, decodability, checksums of each field's uncompressed bytes."""
    if isinstance(checksums, str):
        checksums = json.loads(checksums)
    res = check_files(data_root, segment, token_start, num_tokens, chunk_tokens)
    if not res.ok:
        return res
    reader = reader or SegmentReader(data_root)
    sums = {}
    try:
        arrays = reader.arrays(segment)
        for f in FIELDS:
            sums[f], nbytes = field_checksum(arrays[f], token_start, num_tokens)
            res.raw_bytes += nbytes
    except Exception as e:  # noqa: BLE001 - any decode or I/O failure means the bytes are unreadable
        return SampleCheck((UNREADABLE, f"cannot decode: {type(e).__name__}: {str(e)[:200]}"), res.file_bytes,
                           res.raw_bytes)
    bad = [f for f in FIELDS if sums[f] != checksums.get(f)]
    if bad:
        res.finding = (MISMATCH, f"checksum mismatch in {', '.join(bad)}")
    return res


def check_presence(data_root: Path, segment: str, token_start: int, num_tokens: int,
                   chunk_tokens: int) -> Finding | None:
    """Every file a sample needs must exist and be non-empty (Zarr would silently fill a gap)."""
    return check_files(data_root, segment, token_start, num_tokens, chunk_tokens).finding


def check_location(data_root: Path, segment: str, token_start: int, num_tokens: int, checksums: dict | str,
                   chunk_tokens: int, reader: SegmentReader | None = None) -> Finding | None:
    """Full check of one sample (see `check_sample`); the finding only."""
    return check_sample(data_root, segment, token_start, num_tokens, checksums, chunk_tokens, reader).finding
