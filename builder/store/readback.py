"""Reading samples back and checking them against the checksums recorded in their `written` events: what a
verify sweep, a worker's --verify-after-write and the log's rebuild from the data (its read-back) all run.

Two levels, like restic's `check` and `check --read-data`:

- structural (`check_files`): the segment's metadata files and every chunk file the sample needs exist, none is
  empty, and (quick mode) each has a plausible size and together they hold exactly the bytes the `written`
  event recorded. Zarr silently returns fill values for a missing chunk, so absence is checked, never inferred.
- full (`check_sample`): the above, then a read back through Zarr and a crc32c of each field's uncompressed
  bytes, compared with the `written` event's checksums.

Each returns a `SampleCheck`: a `Finding` (reason, message) when the data is bad, reasons being those
`plan.DAMAGE_REASONS` re-extracts. Two kinds of trouble are kept apart (docs/verify.md):

- **the data is bad**: a missing or empty file, bytes that are present but do not decode or decode to the wrong
  size, a checksum mismatch. These are findings; a sweep records them as `failed`.
- **the check could not run**: any other OSError (EMFILE/ENFILE, ENOMEM, EINTR, EAGAIN, EIO, EACCES, ...) and
  MemoryError. `check_files` and `check_sample` let these propagate; `check_with_retries` retries the transient
  ones with backoff and then returns them as `SampleCheck.error`, which condemns nothing.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from builder.errors import DamagedSampleError
from builder.store.dtypes import itemsize
from builder.store.reader import (
    MISMATCH,
    MISSING,
    UNREADABLE,
    SegmentReader,
    metadata_paths,
    parse_checksums,
    probe_chunks,
    probe_metadata,
)
from builder.store.segment import FIELDS
from builder.store.zarr_meta import read_array_meta

Finding = tuple[str, str]  # (reason, message)

__all__ = ["MISMATCH", "MISSING", "UNREADABLE", "Finding", "SampleCheck", "SharedReader", "check_files",
           "check_sample", "check_with_retries", "check_location", "metadata_paths"]

# The check could not run, and trying again may work: a full descriptor table, memory pressure, an interrupted
# or would-block call, an I/O error a flaky device or network filesystem may not repeat.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN, errno.EIO,
                              errno.EBUSY, errno.ETIMEDOUT})
RETRIES = 3  # extra tries of a check that hit a transient error ...
BACKOFF_S = 0.1  # ... after 0.1 s, 0.2 s, 0.4 s
WINDOW_BYTES = 16 << 20  # uncompressed bytes per Zarr read while checksumming


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


def field_specs(seg_dir: Path) -> dict[str, FieldSpec] | None:
    """Chunk geometry of a segment's fields from their zarr.json, or None when any is missing or malformed."""
    specs = {}
    for fld in FIELDS:
        try:
            meta = read_array_meta(seg_dir / fld)
            shape = meta.chunk_shape
            specs[fld] = FieldSpec(shape[0], shape[1] if len(shape) > 1 else 1, itemsize(meta.data_type, default=8),
                                   meta.shard_chunks)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    return specs


def segment_chunk_tokens(seg_dir: Path) -> int | None:
    specs = field_specs(seg_dir)
    return specs["input_ids"].chunk_tokens if specs else None


class SharedReader(SegmentReader):
    """A SegmentReader whose cache of opened segments is safe to share between threads checking samples."""

    def __init__(self, data_root: Path):
        super().__init__(data_root)
        self._lock = threading.Lock()

    def arrays(self, segment: str) -> dict:
        with self._lock:
            return super().arrays(segment)


@dataclass
class SampleCheck:
    """The outcome of checking one sample: a finding (None when good) and what it cost."""

    finding: Finding | None
    file_bytes: int = 0  # compressed bytes of its chunk files (read in a full check)
    raw_bytes: int = 0  # uncompressed bytes checksummed
    error: str | None = None  # the check could not run (see check_with_retries); nothing is known of the data

    @property
    def ok(self) -> bool:
        return self.finding is None and self.error is None


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
    """Structural check of one sample, reading no data: every file it needs is there and non-empty (each is
    opened, `store.reader.probe_file`). `quick` adds the size plausibility checks (`specs`: the segment's field
    geometry when the caller has it cached). An OSError that is not "no such file" propagates."""
    seg = data_root / segment
    try:
        probe_metadata(data_root, segment)
        files = probe_chunks(data_root, segment, token_start, num_tokens, chunk_tokens)
    except DamagedSampleError as e:
        return SampleCheck((e.reason, e.problem))
    total = sum(size for fld in FIELDS for _, size in files[fld])
    if not quick:
        return SampleCheck(None, total)
    if specs is None:
        specs = field_specs(seg)
    if specs is None:
        return SampleCheck((UNREADABLE, f"segment {segment}: array metadata (zarr.json) is malformed"))
    for fld in FIELDS:
        if specs[fld].shard_chunks:
            continue  # a shard's index accounts for its bytes exactly (checked when it was probed)
        for p, size in files[fld]:
            if size > specs[fld].max_chunk_bytes:
                return SampleCheck((UNREADABLE, f"chunk file {p.relative_to(seg)} holds {size} bytes, more than a "
                                                f"chunk can ({specs[fld].max_chunk_bytes})"), total)
    if nbytes is not None and total != nbytes:
        return SampleCheck((UNREADABLE, f"chunk files hold {total} bytes, the written event recorded {nbytes} "
                                        "(truncated or rewritten)"), total)
    return SampleCheck(None, total)


def check_sample(data_root: Path, segment: str, token_start: int, num_tokens: int, checksums: dict | str,
                 chunk_tokens: int, reader: SegmentReader | None = None) -> SampleCheck:
    """Full check of one sample: presence, decodability, checksums of each field's uncompressed bytes.
    An OSError that is not "no such file", and MemoryError, propagate: the check could not run."""
    want = parse_checksums(checksums)
    res = check_files(data_root, segment, token_start, num_tokens, chunk_tokens)
    if not res.ok:
        return res
    reader = reader or SegmentReader(data_root)
    sums = {}
    fld = FIELDS[0]
    try:
        arrays = reader.arrays(segment)
        for fld in FIELDS:
            sums[fld], nbytes = field_checksum(arrays[fld], token_start, num_tokens)
            res.raw_bytes += nbytes
    except DamagedSampleError as e:
        return SampleCheck((e.reason, e.problem), res.file_bytes, res.raw_bytes)
    except (OSError, MemoryError):
        raise  # the check could not run; says nothing about the bytes
    except Exception as e:  # noqa: BLE001 - the files are present (checked above): their bytes do not decode
        return SampleCheck((UNREADABLE, f"{fld} does not decode: {type(e).__name__}: {str(e)[:200]}"),
                           res.file_bytes, res.raw_bytes)
    bad = [f for f in FIELDS if sums[f] != want.get(f)]
    if bad:
        res.finding = (MISMATCH, f"checksum mismatch in {', '.join(bad)}")
    return res


def is_transient(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS)


def describe_error(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        where = f": {e.filename}" if e.filename else ""
        return f"{name} ({e.strerror}){where}"
    return f"{type(e).__name__}: {str(e)[:200]}" if str(e) else type(e).__name__


def check_with_retries(check: Callable[[], SampleCheck], retries: int = RETRIES, backoff: float = BACKOFF_S,
                       sleep: Callable[[float], object] = time.sleep,
                       first_error: BaseException | None = None) -> SampleCheck:
    """Run a check; when it could not run (OSError other than "no such file", MemoryError), try again after
    `backoff`, doubling, up to `retries` more times if the error may be transient. Still failing: a SampleCheck
    with `error` set and no finding (the sample is not condemned). `sleep` returning true stops the retries
    (pass `threading.Event.wait` to stop at once on Ctrl-C). `first_error`: a transient error the first try
    already hit (a check of the sample's whole group, verify/batch.py): `check` runs as the second try, after
    the first backoff."""
    tries = 0 if first_error is None else 1
    e: BaseException | None = first_error
    while True:
        if e is not None:
            if not is_transient(e) or tries > retries or sleep(backoff * 2 ** (tries - 1)):
                return SampleCheck(None, error=f"could not check: {describe_error(e)} "
                                               f"({tries} {'try' if tries == 1 else 'tries'})")
            e = None
        tries += 1
        try:
            return check()
        except DamagedSampleError as err:
            return SampleCheck((err.reason, err.problem))
        except (OSError, MemoryError) as err:
            e = err


def check_location(data_root: Path, segment: str, token_start: int, num_tokens: int, checksums: dict | str,
                   chunk_tokens: int, reader: SegmentReader | None = None) -> Finding | None:
    """Full check of one sample (see `check_sample`); the finding only. When the check cannot run (EMFILE,
    EIO, MemoryError, ...) the error propagates: a caller MUST NOT take that for a good sample."""
    return check_sample(data_root, segment, token_start, num_tokens, checksums, chunk_tokens, reader).finding
