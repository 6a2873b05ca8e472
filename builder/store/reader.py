"""Reading samples back from segments, by location, checked.

Zarr silently returns the fill value (zeros) for a chunk file that is missing, so a reader MUST NOT infer
presence from the values. `SegmentReader.read` therefore always opens every metadata and chunk file the sample
needs before Zarr reads it, and (unless `verify_checksums=False`) compares each field's CRC-32C with the
checksums of the sample's `written` event. Damage raises `DamagedSampleError` (reason `missing_data`,
`unreadable` or `checksum_mismatch`); an OSError that does not say the bytes are bad (EMFILE, EIO, EACCES, ...)
and MemoryError propagate unchanged: the read could not run, the data is not known to be damaged.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from builder.errors import DamagedSampleError
from builder.store.codec import checksum, from_storage
from builder.store.direct import FieldLayout, read_field
from builder.store.segment import DIMS, FIELDS, chunk_paths_v1, field_geometry
from builder.store.shard import EMPTY, ShardGeometry, ShardIndexError, read_index, shard_path

MISSING, UNREADABLE, MISMATCH = "missing_data", "unreadable", "checksum_mismatch"
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})  # the file (or a directory above it) is not there

if TYPE_CHECKING:
    import torch


def probe_file(path: Path) -> int:
    """Open a file for reading, as Zarr's read will, and return its size. The one place readers and checks touch
    a data file before Zarr does, so a missing file raises FileNotFoundError here (Zarr would fill zeros) and a
    descriptor table that is full raises EMFILE here, with the real errno."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def metadata_paths(seg_dir: Path) -> list[Path]:
    return [seg_dir / "zarr.json"] + [seg_dir / f / "zarr.json" for f in FIELDS]


def _probe(seg_dir: Path, path: Path, segment: str, field: str | None, what: str) -> int:
    """Size of one file the sample needs (probe_file); DamagedSampleError when it is gone or empty."""
    rel = path.relative_to(seg_dir)
    try:
        size = probe_file(path)
    except OSError as e:
        if e.errno not in GONE_ERRNOS:
            raise  # not a statement about the data: the caller decides (retry, report, propagate)
        problem = "the segment directory is gone" if not seg_dir.is_dir() else f"{what} {rel} is missing"
        raise DamagedSampleError(MISSING, problem, segment=segment, field=field) from e
    if size == 0:
        raise DamagedSampleError(UNREADABLE, f"{what} {rel} is empty", segment=segment, field=field)
    return size


def probe_metadata(data_root: Path, segment: str) -> None:
    """The segment's and each field's zarr.json exist and are non-empty."""
    seg = Path(data_root) / segment
    for p in metadata_paths(seg):
        _probe(seg, p, segment, p.parent.name if p.parent != seg else None, "metadata file")


def probe_chunks(data_root: Path, segment: str, token_start: int, num_tokens: int,
                 chunk_tokens: int) -> dict[str, list[tuple[Path, int]]]:
    """Every file of the sample's token range, per field, with the sample's bytes in it: its shard files (layout
    2: each shard's index must pass its CRC-32C and list every inner chunk of the sample; the size given is
    the sample's inner chunks in that shard) or its own chunk files (layout 1: their sizes). Raises
    DamagedSampleError for a missing, empty or inconsistent one."""
    seg = Path(data_root) / segment
    out: dict[str, list[tuple[Path, int]]] = {}
    for f in FIELDS:
        try:
            inner, shard_chunks = field_geometry(seg, f)
        except OSError:
            raise
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise DamagedSampleError(UNREADABLE, f"{f}/zarr.json does not parse ({e})", segment=segment,
                                     field=f) from e
        if not shard_chunks:
            out[f] = [(p, _probe(seg, p, segment, f, "chunk file"))
                      for p in chunk_paths_v1(seg, f, token_start, num_tokens, inner)]
            continue
        out[f] = [(p, _probe_shard(seg, p, segment, f, s, inner, shard_chunks, token_start, num_tokens))
                  for s, p in ((s, shard_path(seg, f, DIMS[f], s))
                               for s in ShardGeometry(inner, shard_chunks).shards(token_start, num_tokens))]
    return out


def _probe_shard(seg_dir: Path, path: Path, segment: str, field: str, shard: int, inner: int, shard_chunks: int,
                 token_start: int, num_tokens: int) -> int:
    """The bytes of the sample's inner chunks in one shard file; DamagedSampleError when the file is gone or
    empty, its index fails its check, or a chunk of the sample is absent from it."""
    _probe(seg_dir, path, segment, field, "shard file")
    rel = path.relative_to(seg_dir)
    try:
        idx = read_index(path, shard_chunks)
    except ShardIndexError as e:
        raise DamagedSampleError(UNREADABLE, f"shard file {rel}: {e}", segment=segment, field=field) from e
    first = max(token_start // inner, shard * shard_chunks)
    last = min((token_start + max(num_tokens, 1) - 1) // inner, (shard + 1) * shard_chunks - 1)
    rows = idx[first - shard * shard_chunks : last - shard * shard_chunks + 1]
    absent = rows[:, 0] == EMPTY
    if absent.any():
        k = first + int(np.argmax(absent))
        raise DamagedSampleError(MISSING, f"shard file {rel} lacks chunk {k} of the sample", segment=segment,
                                 field=field)
    return int(rows[:, 1].sum())


def parse_checksums(checksums: dict | str | None) -> dict[str, str]:
    if checksums is None or checksums == "":
        return {}
    return json.loads(checksums) if isinstance(checksums, str) else dict(checksums)


class SegmentReader:
    """Reads samples back by location. Keeps opened arrays per segment.

    `read` / `read_raw` always check that every file the sample needs is present; given the `written` event's
    checksums they also compare each field's CRC-32C (crc32c runs at tens of GB/s: a small cost next to
    decompression), unless the reader was made with `verify_checksums=False`."""

    def __init__(self, data_root: Path, verify_checksums: bool = True):
        self.data_root = Path(data_root)
        self.verify_checksums = verify_checksums
        self._cache: dict[str, dict] = {}
        self._layouts: dict[str, dict[str, FieldLayout] | None] = {}

    def arrays(self, segment: str) -> dict:
        if segment not in self._cache:
            probe_metadata(self.data_root, segment)
            import zarr  # noqa: PLC0415 - only a reader of a segment's arrays pays for zarr's import

            try:
                group = zarr.open_group(store=str(self.data_root / segment), mode="r")
                arrays = {f: group[f] for f in FIELDS}
            except (OSError, MemoryError):
                raise
            except Exception as e:  # noqa: BLE001 - the metadata files are present but do not parse
                raise DamagedSampleError(UNREADABLE, f"array metadata does not parse: {type(e).__name__}: "
                                                     f"{str(e)[:200]}", segment=segment) from e
            self._cache[segment] = arrays
        return self._cache[segment]

    def chunk_tokens(self, segment: str) -> int:
        return int(self.arrays(segment)["input_ids"].chunks[0])

    def probe(self, segment: str, token_start: int, num_tokens: int) -> dict[str, list[tuple[Path, int]]]:
        """The sample's chunk files and their sizes; DamagedSampleError if one is missing or empty."""
        return probe_chunks(self.data_root, segment, token_start, num_tokens, self.chunk_tokens(segment))

    def read_raw(self, segment: str, token_start: int, num_tokens: int,
                 checksums: dict | str | None = None, fields: tuple[str, ...] = FIELDS) -> dict[str, np.ndarray]:
        """The sample's stored arrays (bf16 as uint16), all fields or `fields`. Presence is always checked;
        `checksums` (the `written` event's, as JSON or a dict) are compared when given and this reader verifies
        checksums."""
        direct = self._direct(segment)
        out = {}
        if direct is not None:  # layout 2, written by hsbuild: read the shards directly (store/direct.py)
            seg_dir = self.data_root / segment
            for f in fields:
                out[f] = read_field(seg_dir, segment, f, direct[f], token_start, num_tokens)
            self._compare(out, checksums, segment, fields)
            return out
        arrs = self.arrays(segment)
        self.probe(segment, token_start, num_tokens)
        for f in fields:
            try:
                out[f] = arrs[f][token_start : token_start + num_tokens]
            except (OSError, MemoryError):
                raise
            except Exception as e:  # noqa: BLE001 - bytes that are present but do not decode (or decode short)
                raise DamagedSampleError(UNREADABLE, f"chunk files do not decode: {type(e).__name__}: "
                                                     f"{str(e)[:200]}", segment=segment, field=f) from e
        self._compare(out, checksums, segment, fields)
        return out

    def _compare(self, out: dict[str, np.ndarray], checksums, segment: str, fields: tuple[str, ...]) -> None:
        want = parse_checksums(checksums) if self.verify_checksums else {}
        if want:
            for f in fields:
                got = checksum(out[f])
                if got != want.get(f):
                    raise DamagedSampleError(MISMATCH, f"checksum mismatch: the bytes read give {got}, the written "
                                                       f"event recorded {want.get(f)}", segment=segment, field=f)

    def _direct(self, segment: str) -> dict[str, FieldLayout] | None:
        """The segment's field layouts when every field can be read directly (cached per segment)."""
        if segment not in self._layouts:
            probe_metadata(self.data_root, segment)
            seg_dir = self.data_root / segment
            try:
                lays = {f: FieldLayout.of(seg_dir, f) for f in FIELDS}
            except OSError:
                raise
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise DamagedSampleError(UNREADABLE, f"array metadata does not parse: {type(e).__name__}: "
                                                     f"{str(e)[:200]}", segment=segment) from e
            self._layouts[segment] = None if any(v is None for v in lays.values()) else lays  # type: ignore[assignment]
        return self._layouts[segment]

    def read(self, segment: str, token_start: int, num_tokens: int,
             checksums: dict | str | None = None) -> dict[str, torch.Tensor]:
        """`read_raw` as tensors in the logical dtype (bfloat16 restored bit-exact)."""
        import torch  # noqa: PLC0415 - (not at import: checks and the log's rebuild read raw arrays only)

        raw = self.read_raw(segment, token_start, num_tokens, checksums)
        direct = self._direct(segment)
        out = {}
        for f, a in raw.items():
            if direct is not None:
                logical, quantized = direct[f].logical, direct[f].quantized
            else:
                attrs = self.arrays(segment)[f].attrs
                logical, quantized = attrs.get("logical_dtype"), attrs.get("quantized")
            out[f] = from_storage(a, logical, quantized) if logical else torch.from_numpy(np.ascontiguousarray(a))
        return out
