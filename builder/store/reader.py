"""Reading samples back from segments, by location, checked.

Zarr silently returns the fill value (zeros) for a chunk file that is missing, so a reader MUST NOT infer
presence from the values. `SegmentReader.read` therefore always opens every metadata and chunk file the sample
needs before Zarr reads it, and (unless `verify_checksums=False`) compares each field's CRC-32C with the
checksums of the sample's `written` event. Damage raises `DamagedSampleError` (reason `missing_data`,
`unreadable` or `checksum_mismatch`); an OSError that does not say the bytes are bad (EMFILE, EIO, EACCES, ...)
and MemoryError propagate unchanged: the read could not run, the data is not known to be damaged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from builder.errors import DamagedSampleError
from builder.store.codec import checksum, from_storage
from builder.store.damage import MISMATCH, MISSING, UNREADABLE, needed, not_empty, shard_rows
from builder.store.direct import FieldLayout, read_field
from builder.store.segment import DIMS, FIELDS, chunk_paths_v1
from builder.store.shard import ShardGeometry, shard_path
from builder.store.zarr_meta import ZARR_JSON, ArrayMeta, read_array_meta

__all__ = ["MISMATCH", "MISSING", "UNREADABLE", "SegmentReader", "metadata_paths", "parse_checksums", "probe_chunks",
           "probe_file", "probe_metadata"]

if TYPE_CHECKING:
    import torch

RUN_BYTES = 32 << 20  # `read_many`: samples read together up to about this many decoded bytes a run


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
    return [seg_dir / ZARR_JSON] + [seg_dir / f / ZARR_JSON for f in FIELDS]


def _probe(seg_dir: Path, path: Path, segment: str, field: str | None, what: str) -> int:
    """Size of one file the sample needs (probe_file); DamagedSampleError when it is gone or empty."""
    with needed(seg_dir, path, segment, field, what):
        size = probe_file(path)
    return not_empty(size, path.relative_to(seg_dir), segment, field, what)


def probe_metadata(data_root: Path, segment: str) -> None:
    """The segment's and each field's zarr.json exist and are non-empty."""
    seg = Path(data_root) / segment
    for p in metadata_paths(seg):
        _probe(seg, p, segment, p.parent.name if p.parent != seg else None, "metadata file")


def field_meta(seg_dir: Path, segment: str, fld: str) -> ArrayMeta:
    """A field's zarr.json, parsed (`zarr_meta.read_array_meta`); DamagedSampleError when it does not parse, an
    OSError when it cannot be read."""
    try:
        return read_array_meta(seg_dir / fld)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise DamagedSampleError(UNREADABLE, f"{fld}/zarr.json does not parse ({e})", segment=segment,
                                 field=fld) from e


def probe_chunks(data_root: Path, segment: str, token_start: int, num_tokens: int,
                 chunk_tokens: int) -> dict[str, list[tuple[Path, int]]]:
    """Every file of the sample's token range, per field, with the sample's bytes in it: its shard files (layout
    2: each shard's index must pass its CRC-32C and list every inner chunk of the sample; the size given is
    the sample's inner chunks in that shard) or its own chunk files (layout 1: their sizes). Raises
    DamagedSampleError for a missing, empty or inconsistent one."""
    seg = Path(data_root) / segment
    out: dict[str, list[tuple[Path, int]]] = {}
    for f in FIELDS:
        meta = field_meta(seg, segment, f)
        inner, shard_chunks = meta.chunk_tokens, meta.shard_chunks
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
    first = max(token_start // inner, shard * shard_chunks)
    last = min((token_start + max(num_tokens, 1) - 1) // inner, (shard + 1) * shard_chunks - 1)
    with needed(seg_dir, path, segment, field, "shard file"):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        rows = shard_rows(fd, path.relative_to(seg_dir), segment, field, shard, shard_chunks,
                          first - shard * shard_chunks, last - shard * shard_chunks)
    finally:
        os.close(fd)
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
        self._metas: dict[str, dict[str, ArrayMeta]] = {}
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

    def metas(self, segment: str) -> dict[str, ArrayMeta]:
        """The segment's fields' array metadata (cached per segment); DamagedSampleError when a file is missing,
        empty or does not parse."""
        if segment not in self._metas:
            probe_metadata(self.data_root, segment)
            self._metas[segment] = {f: field_meta(self.data_root / segment, segment, f) for f in FIELDS}
        return self._metas[segment]

    def _direct(self, segment: str) -> dict[str, FieldLayout] | None:
        """The segment's field layouts when every field can be read directly (cached per segment)."""
        if segment not in self._layouts:
            metas = self.metas(segment)
            try:
                lays = {f: FieldLayout.from_meta(m) for f, m in metas.items()}
            except (ValueError, KeyError, IndexError, TypeError) as e:  # (a data_type numpy does not know)
                raise DamagedSampleError(UNREADABLE, f"array metadata does not parse: {type(e).__name__}: "
                                                     f"{str(e)[:200]}", segment=segment) from e
            self._layouts[segment] = None if any(v is None for v in lays.values()) else lays  # type: ignore[assignment]
        return self._layouts[segment]

    def read(self, segment: str, token_start: int, num_tokens: int,
             checksums: dict | str | None = None) -> dict[str, torch.Tensor]:
        """`read_raw` as tensors in the logical dtype (bfloat16 restored bit-exact)."""
        import torch  # noqa: PLC0415 - (not at import: checks and the log's rebuild read raw arrays only)

        raw = self.read_raw(segment, token_start, num_tokens, checksums)
        metas = self.metas(segment)
        out = {}
        for f, a in raw.items():
            logical, quantized = metas[f].logical_dtype, metas[f].quantized
            out[f] = from_storage(a, logical, quantized) if logical else torch.from_numpy(np.ascontiguousarray(a))
        return out

    def read_many(self, items: Sequence[tuple[str, int, int, dict | str | None]], fields: tuple[str, ...] = FIELDS,
                  tensors: bool = True) -> list[dict | DamagedSampleError]:
        """Samples (segment, token_start, num_tokens, checksums) as `read` (tensors) or `read_raw` gives each,
        in order, a DamagedSampleError in place of a damaged one. The samples of a segment that lie one after
        another (up to a chunk apart) are read together, a field at a time (one read and one index check per
        shard file, each chunk decoded once, instead of once per sample), then each sample's rows checked
        against its own checksums; a run whose read fails, and a sample whose rows fail, are read alone, which
        decides and words the damage as `read` does."""
        out: list[dict | DamagedSampleError | None] = [None] * len(items)
        by_seg: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            by_seg.setdefault(it[0], []).append(i)
        for seg, idxs in by_seg.items():
            try:
                lays = self._direct(seg)
            except DamagedSampleError:
                lays = None
            if lays is not None:
                for run in self._runs(items, sorted(idxs, key=lambda i: items[i][1]), lays, fields):
                    self._read_run(seg, lays, items, run, fields, tensors, out)
        for i, it in enumerate(items):  # the rest: alone
            if out[i] is None:
                try:
                    out[i] = self.read(*it) if tensors else self.read_raw(*it, fields=fields)
                except DamagedSampleError as e:
                    out[i] = e
        return out  # type: ignore[return-value]

    @staticmethod
    def _runs(items: Sequence[tuple], idxs: list[int], lays: dict[str, FieldLayout],
              fields: tuple[str, ...]) -> list[list[int]]:
        """`idxs` (in token order) cut into runs of samples at most a chunk apart, about RUN_BYTES decoded each."""
        per_token = sum(lays[f].dtype.itemsize * max(lays[f].width, 1) for f in fields)
        gap = min(lays[f].inner for f in fields)
        runs: list[list[int]] = []
        start = end = 0
        for i in idxs:
            lo, n = int(items[i][1]), int(items[i][2])
            if runs and lo - end <= gap and (max(end, lo + n) - start) * per_token <= RUN_BYTES:
                runs[-1].append(i)
                end = max(end, lo + n)
            else:
                runs.append([i])
                start, end = lo, lo + n
        return [r for r in runs if len(r) > 1]

    def _read_run(self, seg: str, lays: dict[str, FieldLayout], items: Sequence[tuple], run: list[int],
                  fields: tuple[str, ...], tensors: bool, out: list) -> None:
        lo = int(items[run[0]][1])
        hi = max(int(items[i][1]) + int(items[i][2]) for i in run)
        try:
            whole = {f: read_field(self.data_root / seg, seg, f, lays[f], lo, hi - lo) for f in fields}
        except DamagedSampleError:
            return  # each read alone
        metas = self.metas(seg) if tensors else {}
        for i in run:
            _, start, n, sums = items[i]
            raw = {f: whole[f][int(start) - lo: int(start) - lo + int(n)] for f in fields}
            try:
                self._compare(raw, sums, seg, fields)
            except DamagedSampleError:
                continue  # read alone
            if not tensors:
                out[i] = {f: np.array(a) for f, a in raw.items()}
                continue
            out[i] = {f: from_storage(a, metas[f].logical_dtype, metas[f].quantized) if metas[f].logical_dtype
                      else _tensor(a) for f, a in raw.items()}


def _tensor(a: np.ndarray) -> torch.Tensor:
    import torch  # noqa: PLC0415

    return torch.from_numpy(np.ascontiguousarray(a))
