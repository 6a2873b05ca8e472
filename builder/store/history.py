"""The build's history beside its data: small write-once records of what the segments cannot say about
themselves and a lost event log would take with it (docs/design.md section 11, "History records").

    data/history/<ordinal>-<kind>-<id8>.json     ordinal: 10 digits, 1 + the highest one present

    run      a run that writes: its ordinal is taken at its start, the record written before its first
             segment is created; its segments (seg-<id8>-w<NN>-<rand6>, id8 = the run id's first 8 hex digits)
             take its ordinal
    skip     `hsbuild skip`: the samples retired, each with its fingerprint and the note
    unskip   `hsbuild skip --undo`: the samples brought back
    verify   a verify sweep's verdicts, by location: {segment: {verdict: [token_start, ...]}}
    drop     a regenerating run's responses that stopped at the token limit, retired (--drop-truncated): each
             sample with its fingerprint, attempt and generation figures (generated, finish_reason, seed, turns);
             written by the run's coordinator (it holds the lock) for a batch of them before their `retired`
             events commit, with an ordinal above the run's own

The ordinal orders everything that changed a sample's state, across runs, skips and sweeps, without a clock:
each is taken under the build lock, one more than the highest already there, so it never goes backwards
(a wall clock may). `rebuild-log` replays the records in that order on top of the segments' manifests.

A record is written once: a temp file (`.<name>.<pid>.tmp`, what gc reclaims after a crash), fsynced, linked to
its name (never over an existing file), the temp name removed, the directory fsynced. Nothing here prints.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import DiskFullError, UsageError, is_no_space
from builder.fsutil import fsync_path, make_dirs_durable

HISTORY_DIR = "history"
RECORD_FORMAT = 1
KINDS = ("run", "skip", "unskip", "verify", "drop")
VERDICTS = ("verified", "checksum_mismatch", "missing_data", "unreadable")
NAME_RE = re.compile(rf"^(\d{{10}})-({'|'.join(KINDS)})-([0-9a-f]{{8}})\.json$")


@dataclass(frozen=True)
class HistoryRecord:
    ordinal: int
    kind: str
    ident: str  # the run's, sweep's or skip's id (8 hex digits in the name, whole in the record)
    at: float  # wall-clock time of writing (shown, never used to order)
    body: dict
    name: str


def history_dir(data_root: Path) -> Path:
    return Path(data_root) / HISTORY_DIR


def _names(data_root: Path) -> list[tuple[int, str, str, str]]:
    """(ordinal, kind, id8, name) of every record, by ordinal; other files (temp files) are not records."""
    try:
        names = os.listdir(history_dir(data_root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for n in names:
        m = NAME_RE.match(n)
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3), n))
    return sorted(out)


def next_ordinal(data_root: Path) -> int:
    names = _names(data_root)
    return names[-1][0] + 1 if names else 1


def run_ordinals(data_root: Path) -> dict[str, int]:
    """id8 of each recorded run -> its ordinal (from the names alone: nothing is read)."""
    return {id8: o for o, kind, id8, _ in _names(data_root) if kind == "run"}


def segment_run(segment: str) -> str:
    """The id8 of the run that wrote a segment (`seg-<id8>-w<NN>-<rand6>`)."""
    parts = segment.split("-")
    return parts[1] if len(parts) >= 4 else ""


def _record_name(ordinal: int, kind: str, ident: str) -> str:
    return f"{ordinal:010d}-{kind}-{ident[:8]}.json"


def _write_once(d: Path, name: str, data: bytes, exist_ok: bool = False) -> None:
    """`d/name` created with `data`, durable: a temp file fsynced, linked to the name (never replacing a file:
    FileExistsError unless `exist_ok`, when another process wrote the same record first), the directory
    fsynced. A failure leaves at most the temp file (what gc reclaims)."""
    if not d.is_dir():
        make_dirs_durable(d)
    tmp = d / f".{name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, d / name)
        except FileExistsError:
            if not exist_ok:
                raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(d)


def _record_bytes(kind: str, ordinal: int, ident: str, at: float, body: dict) -> bytes:
    return json.dumps({"format": RECORD_FORMAT, "kind": kind, "ordinal": ordinal, "id": ident, "at": at, **body},
                      sort_keys=True).encode()


def write_record(data_root: Path, kind: str, ident: str, body: dict, after: int = 0) -> HistoryRecord:
    """Write one record (a skip, an unskip, a sweep's verdicts, a run's drops), durable when this returns. The
    caller MUST hold the build lock (the ordinal is the next free one, and above `after`: a run's drops come
    after the run's own ordinal, whose record its writers may not have written yet). A full volume raises
    DiskFullError."""
    if kind not in KINDS:
        raise ValueError(f"history record kind {kind!r}")
    d = history_dir(data_root)
    try:
        ordinal = max(next_ordinal(data_root), after + 1)
        rec = HistoryRecord(ordinal, kind, ident, time.time(), body, _record_name(ordinal, kind, ident))
        _write_once(d, rec.name, _record_bytes(kind, ordinal, ident, rec.at, body))
    except OSError as e:
        if is_no_space(e):
            raise DiskFullError(f"{d}: cannot write the {kind} history record: the volume is full; free space "
                                "and run the command again") from e
        raise
    return rec


def ensure_run_record(data_root: Path, ordinal: int, run_id: str) -> None:
    """The run's record (ordinal taken by the run under the build lock, `next_ordinal`), durable when this
    returns: each writer of the run calls it before creating a segment, so no segment exists without its run's
    record. The first call writes it, the others find it. Raises OSError as it comes (ENOSPC: the caller
    pauses and tries again, as for any write of its segment)."""
    d = history_dir(data_root)
    name = _record_name(ordinal, "run", run_id)
    if (d / name).is_file():
        fsync_path(d)  # (written by another writer of the run, perhaps not yet made durable by it)
        return
    _write_once(d, name, _record_bytes("run", ordinal, run_id, time.time(), {}), exist_ok=True)


def record_names(data_root: Path, kind: str) -> list[str]:
    """The names of the records of one kind, by ordinal (from the names alone: nothing is read)."""
    return [name for _, k, _, name in _names(data_root) if k == kind]


def read_history(data_root: Path, kinds: tuple[str, ...] = KINDS, names: set[str] | None = None
                 ) -> list[HistoryRecord]:
    """Every record (of these kinds; of these names), by ordinal. One that cannot be read whole is refused
    (UsageError naming it): without it the history cannot be replayed faithfully, and hsbuild does not guess."""
    out = []
    for ordinal, kind, _id8, name in _names(data_root):
        if kind not in kinds or (names is not None and name not in names):
            continue
        p = history_dir(data_root) / name
        try:
            doc = json.loads(p.read_bytes())
            ok = (isinstance(doc, dict) and doc.get("format") == RECORD_FORMAT and doc.get("kind") == kind
                  and doc.get("ordinal") == ordinal)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise UsageError(f"{p}: a damaged history record (not a format-{RECORD_FORMAT} {kind} record); the "
                             "history it held cannot be replayed. Restore it from a backup, or move it out of "
                             f"{history_dir(data_root)} to rebuild without it (a lost {kind} record: "
                             f"{LOST_RECORD[kind]})")
        body = {k: v for k, v in doc.items() if k not in ("format", "kind", "ordinal", "id", "at")}
        out.append(HistoryRecord(ordinal, kind, str(doc.get("id", "")), float(doc.get("at") or 0.0), body, name))
    return out


LOST_RECORD = {
    "run": "its segments are ordered by their manifests' wall-clock times, as builds before history records are",
    "skip": "its samples come back as what their data says, not skipped",
    "unskip": "its samples come back skipped",
    "verify": "its samples come back written, not verified",
    "drop": "its samples come back pending, and the next run generates them again (and drops them again)",
}


@dataclass
class Verdicts:
    """A verify sweep's verdicts by location, as its record holds them."""

    by_segment: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    count: int = 0

    def add(self, segment: str, token_start: int, verdict: str) -> None:
        self.by_segment.setdefault(segment, {}).setdefault(verdict, []).append(int(token_start))
        self.count += 1

    def extend(self, segment: str, token_starts: list[int], verdict: str) -> None:
        """`add` for samples of one segment with one verdict."""
        self.by_segment.setdefault(segment, {}).setdefault(verdict, []).extend(map(int, token_starts))
        self.count += len(token_starts)

    def write(self, data_root: Path, sweep_id: str, mode: str) -> HistoryRecord | None:
        """The sweep's record (none when it judged nothing)."""
        if not self.count:
            return None
        return write_record(data_root, "verify", sweep_id, {"mode": mode, "verdicts": self.by_segment})
