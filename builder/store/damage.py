"""How the store says that a sample's files are damaged: the reasons, and the checks every reader runs on the
files a sample needs (store/reader.py, store/direct.py, the verify checks through them).

Damage is a `DamagedSampleError` with one of the reasons `missing_data`, `unreadable`, `checksum_mismatch`
(what `plan.DAMAGE_REASONS` re-extracts); an OSError that says nothing about the bytes (EMFILE, EIO, EACCES, ...)
propagates unchanged: the read could not run, the data is not known to be damaged.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from builder.errors import DamagedSampleError
from builder.store.shard import EMPTY, ShardIndexError, read_index

MISSING, UNREADABLE, MISMATCH = "missing_data", "unreadable", "checksum_mismatch"
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})  # the file (or a directory above it) is not there


@contextmanager
def needed(seg_dir: Path, path: Path, segment: str, field: str | None, what: str) -> Iterator[None]:
    """Around the opening of a file a sample needs: a file (or segment directory) that is not there raises
    DamagedSampleError(missing_data); any other OSError propagates unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno not in GONE_ERRNOS:
            raise  # not a statement about the data: the caller decides (retry, report, propagate)
        problem = ("the segment directory is gone" if not seg_dir.is_dir()
                   else f"{what} {path.relative_to(seg_dir)} is missing")
        raise DamagedSampleError(MISSING, problem, segment=segment, field=field) from e


def not_empty(size: int, rel: Path, segment: str, field: str | None, what: str) -> int:
    """`size`, unless the file is empty (DamagedSampleError: unreadable)."""
    if size == 0:
        raise DamagedSampleError(UNREADABLE, f"{what} {rel} is empty", segment=segment, field=field)
    return size


def shard_rows(fd: int, rel: Path, segment: str, field: str, shard: int, shard_chunks: int, first: int,
               last: int) -> np.ndarray:
    """The index rows (offset, length) of inner chunks `first`..`last` (positions in the file) of shard `shard`,
    the file open as `fd` (`rel`: its path in the segment), checked: the file is not empty, its index passes
    `shard.read_index`, and every one of those chunks is present. DamagedSampleError otherwise; any other OSError
    propagates."""
    not_empty(os.fstat(fd).st_size, rel, segment, field, "shard file")
    try:
        idx = read_index(fd, shard_chunks)
    except ShardIndexError as e:
        raise DamagedSampleError(UNREADABLE, f"shard file {rel}: {e}", segment=segment, field=field) from e
    rows = idx[first : last + 1]
    absent = rows[:, 0] == EMPTY
    if absent.any():
        k = shard * shard_chunks + first + int(np.argmax(absent))
        raise DamagedSampleError(MISSING, f"shard file {rel} lacks chunk {k} of the sample", segment=segment,
                                 field=field)
    return rows
