"""The samples a sweep checks, held as columns (Arrow and numpy arrays, tens of bytes a sample, not a Python object
each: a sweep of ten million samples must fit beside the build), in the order they are read (segment, token_start),
and cut into units (verify/batch.py). A `Target` is made only for the samples of the unit being checked."""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from builder.log.events import EventLog
from builder.store.direct import FieldLayout
from builder.store.segment import FIELDS
from builder.verify.batch import UNIT_BYTES, UNIT_SAMPLES
from builder.verify.selection import Selection

if TYPE_CHECKING:
    import pyarrow as pa

# every live sample (state written or verified) with its live location and, `written_seq`, the seq of the
# `written` event it is live by (a sweep's --continue compares it with the verdicts already recorded)
SELECT = ("SELECT s.sample_id, s.segment, s.token_start, s.num_tokens, s.nbytes, {checksums} AS checksums, "
          "f.mseq AS written_seq, s.verified_at FROM samples s JOIN sample_fold f USING (sample_id) "
          "WHERE s.state IN ('written', 'verified') ORDER BY s.segment, s.token_start")


@dataclass
class Target:
    """One sample to check: its live location and what its `written` event recorded (TARGET_COLUMNS)."""

    sample_id: str
    segment: str
    token_start: int
    num_tokens: int
    nbytes: int | None
    checksums: str | None  # (None in a quick sweep: it reads no data)
    written_seq: int


TARGET_COLUMNS = ("sample_id", "segment", "token_start", "num_tokens", "nbytes", "checksums", "written_seq")


def fetch(log: EventLog, sql: str) -> pa.Table:
    """A query's result as an Arrow table (columns, no Python object a row)."""
    if log.read_only:  # on the connection itself (an older log's TEMP views live there), a copy more
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return log.con.execute(sql).to_arrow_table()
    cur = log.con.cursor()
    try:
        return cur.sql(sql).to_arrow_table()
    finally:
        cur.close()


class Targets:
    """The selected samples as columns; `units` cuts them into the units a sweep checks, `take` makes their
    Targets."""

    def __init__(self, table: pa.Table):
        import pyarrow.compute as pc  # noqa: PLC0415

        self.table = table
        seg = table.column("segment").combine_chunks().dictionary_encode()
        self.segments: list[str] = seg.dictionary.to_pylist()
        self.seg_code = np.asarray(seg.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
        self.token_start = table.column("token_start").to_numpy().astype(np.int64)
        nbytes = table.column("nbytes")
        self.nbytes = pc.fill_null(nbytes, 0).to_numpy().astype(np.int64)

    def __len__(self) -> int:
        return self.table.num_rows

    def mean_nbytes(self) -> float:
        """The selected samples' mean compressed bytes (their `written` nbytes; 0 when none are selected)."""
        return float(self.nbytes.mean()) if len(self) else 0.0

    def take(self, a: int, b: int) -> list[Target]:
        part = self.table.slice(a, b - a)  # (not verified_at: the selection's, and the slowest to convert)
        return [Target(*r) for r in zip(*(part.column(c).to_pylist() for c in TARGET_COLUMNS), strict=True)]

    def units(self, direct: Callable[[str], dict[str, FieldLayout] | None],
              join: bool = True) -> Iterator[tuple[int, int]]:
        """[start, end) ranges of samples of a segment read directly (`direct(segment)`) that start in one shard or,
        with `join`, in a few consecutive ones (whole shards' samples, so a shard is visited by as few units as may
        be), at most UNIT_SAMPLES of them and about UNIT_BYTES; a sample of a segment read otherwise is a unit
        alone. (A paced sweep keeps one shard a unit: its rate is charged a unit at a time.)"""
        n = len(self)
        if not n:
            return
        spans = np.zeros(len(self.segments), dtype=np.int64)  # tokens a shard of each segment; 0: not direct
        for code, name in enumerate(self.segments):
            lays = direct(name)
            if lays is not None:
                spans[code] = lays[FIELDS[0]].inner * lays[FIELDS[0]].shard_chunks
        span = spans[self.seg_code]
        key = np.where(span > 0, self.token_start // np.maximum(span, 1), np.arange(n))
        cut = np.flatnonzero((np.diff(self.seg_code) != 0) | (np.diff(key) != 0) | (span[1:] == 0)) + 1
        bounds = [0, *cut.tolist(), n]
        before = np.concatenate(([0], np.cumsum(self.nbytes)))
        code, merged = self.seg_code.tolist(), [0]
        for a, b in zip(bounds[1:-1], bounds[2:], strict=True):  # runs in one shard joined while they fit
            c = merged[-1]
            if not (join and span[a] > 0 and span[c] > 0 and code[a] == code[c] and b - c <= UNIT_SAMPLES
                    and before[b] - before[c] <= UNIT_BYTES):
                merged.append(a)
        merged.append(n)
        for a, b in zip(merged[:-1], merged[1:], strict=True):
            while b - a > 0:  # a run of whole shards, or one shard's cut by count and bytes
                size = np.cumsum(self.nbytes[a : min(b, a + UNIT_SAMPLES)])
                end = a + max(1, int(np.searchsorted(size, UNIT_BYTES, side="right")))
                end = min(end, b, a + UNIT_SAMPLES)
                yield a, end
                a = end


def select(log: EventLog, selection: Selection, quick: bool, done: dict[str, int]) -> tuple[Targets, int, set[str]]:
    """The live samples `selection` covers, less those `done` (sample -> seq of a verdict a sweep being
    continued recorded) holds a verdict for after their current `written`. Returns them, how many were skipped
    that way, and every segment that holds a live sample."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    table = fetch(log, SELECT.format(checksums="NULL::VARCHAR" if quick else "s.checksums"))
    segments = set(pc.unique(table.column("segment")).to_pylist())
    keep = np.ones(table.num_rows, dtype=bool)
    if selection.segments:
        keep &= pc.is_in(table.column("segment"), pa.array(selection.segments)).to_numpy(
            zero_copy_only=False)
    if selection.not_verified_since is not None:
        cut = pa.scalar(dt.datetime.fromisoformat(selection.not_verified_since), pa.timestamp("us"))
        recent = pc.fill_null(pc.greater_equal(table.column("verified_at"), cut), False)
        keep &= ~recent.to_numpy(zero_copy_only=False)
    if selection.subset or selection.fraction is not None:
        ids = table.column("sample_id").to_pylist()
        keep &= np.fromiter((selection.matches_id(s) for s in ids), dtype=bool, count=len(ids))
    skipped = 0
    if done:
        ids = table.column("sample_id").to_pylist()
        seqs = table.column("written_seq").to_pylist()
        fresh = np.fromiter((done.get(s, -1) <= q for s, q in zip(ids, seqs, strict=True)), dtype=bool,
                            count=len(ids))
        skipped = int((keep & ~fresh).sum())
        keep &= fresh
    if not keep.all():
        table = table.filter(pa.array(keep))
    return Targets(table), skipped, segments
