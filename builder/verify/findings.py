"""What a verify sweep found: damaged samples, samples whose check could not run, live samples that share a chunk
(the log says two samples own the same bytes), and the summary a sweep returns (its counts, exit code, JSON)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from builder.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SAMPLES_FAILED
from builder.log.events import EventLog
from builder.verify.gc import OrphanReport
from builder.verify.selection import Selection
from builder.verify.targets import fetch

MB = 1_000_000


@dataclass
class Damage:
    """A sample whose stored bytes are not what its `written` event recorded."""

    sample_id: str
    reason: str  # checksum_mismatch | missing_data | unreadable
    message: str
    segment: str
    token_start: int
    num_tokens: int


@dataclass
class NotChecked:
    """A sample whose check could not run (resources or I/O, not its data): nothing was recorded for it."""

    sample_id: str
    message: str
    segment: str
    token_start: int
    num_tokens: int
    reason: str = "check_error"


@dataclass
class Overlap:
    """Two live samples whose chunk ranges in one segment overlap: at most one of them holds its own bytes."""

    segment: str
    first: str
    second: str
    first_chunks: tuple[int, int]
    second_chunks: tuple[int, int]


@dataclass
class SweepSummary:
    sweep_id: str
    mode: str
    selection: Selection
    started_at: dt.datetime  # UTC, naive
    continues: str | None = None
    selected: int = 0  # samples the selection covers now
    skipped: int = 0  # already checked by the sweep being continued
    checked: int = 0  # samples whose check ran (ok + damaged)
    check_errors: int = 0  # samples whose check could not run (not_checked)
    ok: int = 0
    mismatched: int = 0
    missing: int = 0
    unreadable: int = 0
    bytes_read: int = 0  # compressed chunk-file bytes read (what --max-rate limits)
    raw_bytes: int = 0  # uncompressed bytes checksummed
    seconds: float = 0.0  # the reading phase
    outcome: str = "completed"  # completed | damage_found | check_errors | interrupted
    damaged: list[Damage] = field(default_factory=list)
    not_checked: list[NotChecked] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)
    orphans: OrphanReport = field(default_factory=OrphanReport)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / MB if self.seconds > 0 else 0.0

    @property
    def raw_mb_per_s(self) -> float:
        return self.raw_bytes / self.seconds / MB if self.seconds > 0 else 0.0

    @property
    def damage_found(self) -> bool:
        return bool(self.damaged or self.overlaps)

    @property
    def exit_code(self) -> int:
        """130 interrupted; 1 damage found, or some samples could not be checked (good is not established;
        nothing was condemned: retry); 0 every selected sample was checked and is good."""
        if self.outcome == "interrupted":
            return EXIT_INTERRUPTED
        return EXIT_SAMPLES_FAILED if self.damage_found or self.not_checked else EXIT_OK

    def counts(self) -> dict:
        return {"selected": self.selected, "skipped": self.skipped, "checked": self.checked,
                "check_errors": self.check_errors, "ok": self.ok,
                "mismatched": self.mismatched, "missing": self.missing, "unreadable": self.unreadable,
                "overlaps": len(self.overlaps), "bytes_read": self.bytes_read, "raw_bytes": self.raw_bytes,
                "seconds": round(self.seconds, 3), "mb_per_s": round(self.mb_per_s, 3),
                "raw_mb_per_s": round(self.raw_mb_per_s, 3)}

    def as_dict(self) -> dict:
        return {"sweep_id": self.sweep_id, "mode": self.mode, "outcome": self.outcome,
                "started_at": self.started_at.isoformat() + "Z", "continues": self.continues,
                "selection": asdict(self.selection), **self.counts(),
                "damaged": [asdict(d) for d in self.damaged], "not_checked": [asdict(n) for n in self.not_checked],
                "overlaps": [asdict(o) for o in self.overlaps],
                "reclaimable": self.orphans.as_dict()}


def find_overlaps(log: EventLog, chunk_tokens: Callable[[str], int]) -> list[Overlap]:
    """Live samples sharing a chunk: the log says two samples own the same bytes. In (segment, token_start,
    sample_id) order, a sample overlaps the one before it in its segment that reaches furthest (the first such)."""
    t = fetch(log, "SELECT segment, token_start, num_tokens, sample_id FROM samples "
                   "WHERE state IN ('written', 'verified') ORDER BY segment, token_start, sample_id")
    if not t.num_rows:
        return []
    seg = t.column("segment").combine_chunks().dictionary_encode()
    names = seg.dictionary.to_pylist()
    code = np.asarray(seg.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    ct = np.array([chunk_tokens(n) for n in names], dtype=np.int64)[code]
    start = t.column("token_start").to_numpy().astype(np.int64)
    first = start // ct
    last = (start + np.maximum(t.column("num_tokens").to_numpy().astype(np.int64), 1) - 1) // ct
    key = code * (1 << 40) + last  # the furthest chunk so far, per segment (a new segment starts above)
    reach = np.maximum.accumulate(key)
    rises = np.ones(len(key), dtype=bool)
    rises[1:] = key[1:] > reach[:-1]
    holder = np.maximum.accumulate(np.where(rises, np.arange(len(key)), 0))  # the first row reaching that far
    prev = np.concatenate(([0], holder[:-1]))
    hit = np.zeros(len(key), dtype=bool)
    hit[1:] = (code[1:] == code[:-1]) & (first[1:] <= last[prev[1:]])
    ids = t.column("sample_id")
    out = []
    for i in np.flatnonzero(hit).tolist():
        j = int(prev[i])
        out.append(Overlap(names[code[i]], ids[j].as_py(), ids[i].as_py(), (int(first[j]), int(last[j])),
                           (int(first[i]), int(last[i]))))
    return out
