"""A build's source over time: what changed since the samples were registered, and recording it.

A source may change under a build in three ways: a registered sample's tokens change (a bad row fixed), a
registered sample disappears (a row deleted), a new sample appears (rows appended, or a removed one put back).
New samples are registered silently. Changed and removed ones are refused unless the user accepts them
(`hsbuild resume BUILD --accept-source-changes`); then the log records, in one transaction:

- `superseded` per changed (or returning) sample: fingerprint and num_tokens of the new row, detail {row,
  change, old_fingerprint}. The sample starts over: `pending`, its attempts counted from here, its old data no
  longer live (`hsbuild gc` reclaims it);
- `retired` per removed sample (reason `removed_from_source`): it leaves the live index, the reader and the
  totals; the SQL views keep it with state `retired`;
- `row_moved` per unchanged sample whose row number moved (detail {row}): the reader's row order follows;
- one `source_changed` event with the lists.

`hsbuild skip BUILD ID... --reason TEXT` retires samples that can never succeed (reason `skipped`, detail
{note}); `--undo` brings them back (`superseded`, change `unskipped`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import SourceChangedError, UsageError
from builder.extract.source import Sample
from builder.layout import layout
from builder.log.events import Event, EventLog, detail
from builder.log.lock import BuildLock

SHOW_IDS = 5  # ids named per kind of change in a message


@dataclass
class Current:
    """What the log knows of one registered sample now."""

    row: int
    fingerprint: str
    num_tokens: int
    state: str
    retired_reason: str | None


@dataclass
class SourceDiff:
    changed: list[str] = field(default_factory=list)  # live (or skipped) samples whose tokens changed
    removed: list[str] = field(default_factory=list)  # live samples no longer in the source
    returned: list[str] = field(default_factory=list)  # removed earlier, back in the source
    added: list[str] = field(default_factory=list)  # never registered
    moved: dict[str, int] = field(default_factory=dict)  # unchanged samples now at another row

    @property
    def needs_acceptance(self) -> bool:
        return bool(self.changed or self.removed or self.returned)

    def describe(self) -> str:
        """'2 changed (a, b), 1 removed (c), 3 added (d, e, f)'."""
        parts = []
        for n, ids in (("changed", self.changed), ("removed", self.removed), ("returned", self.returned),
                       ("added", self.added)):
            if ids:
                shown = ", ".join(ids[:SHOW_IDS]) + (f", ... (+{len(ids) - SHOW_IDS})" if len(ids) > SHOW_IDS else "")
                parts.append(f"{len(ids)} {n} ({shown})")
        return ", ".join(parts) or "no change"

    def summary(self) -> dict:
        return {"changed": self.changed, "removed": self.removed, "returned": self.returned, "added": self.added,
                "rows_moved": len(self.moved)}


def current_registry(log: EventLog) -> dict[str, Current]:
    _, rows = log.query("SELECT sample_id, row_idx, fingerprint, source_tokens, state, retired_reason FROM samples")
    return {r[0]: Current(int(r[1]), r[2], int(r[3]), r[4], r[5]) for r in rows}


def diff_source(log: EventLog, samples: Sequence[Sample]) -> SourceDiff:
    known = current_registry(log)
    d = SourceDiff()
    present = set()
    for s in samples:
        present.add(s.sample_id)
        cur = known.get(s.sample_id)
        if cur is None:
            d.added.append(s.sample_id)
        elif cur.retired_reason == "removed_from_source":
            d.returned.append(s.sample_id)
        elif cur.fingerprint != s.fingerprint:
            d.changed.append(s.sample_id)
        elif cur.row != s.row:
            d.moved[s.sample_id] = s.row
    d.removed = [sid for sid, cur in known.items() if sid not in present and cur.state != "retired"]
    return d


def refusal(d: SourceDiff, build: Path | str) -> SourceChangedError:
    return SourceChangedError(
        f"source changed under the build: {d.describe()}; to accept it run `hsbuild resume {build} "
        "--accept-source-changes` (changed samples are extracted again, removed ones retired, the rest kept), "
        "or restore the original source")


def record_source(log: EventLog, samples: Sequence[Sample], d: SourceDiff, emit, source: str) -> None:
    """Register the new samples and emit the events of an accepted change (`emit` commits them in order)."""
    by_id = {s.sample_id: s for s in samples}
    known = current_registry(log) if d.changed or d.returned else {}
    log.register_samples([by_id[sid] for sid in d.added])
    for sid in d.changed + d.returned:
        s = by_id[sid]
        emit(Event("superseded", sample_id=sid, fingerprint=s.fingerprint, num_tokens=s.num_tokens,
                   reason="source_changed" if sid in d.changed else "returned",
                   detail=detail(row=s.row, old_fingerprint=known[sid].fingerprint)))
    for sid in d.removed:
        emit(Event("retired", sample_id=sid, reason="removed_from_source",
                   detail=detail(note="no longer in the source")))
    for sid, row in d.moved.items():
        emit(Event("row_moved", sample_id=sid, fingerprint=by_id[sid].fingerprint, num_tokens=by_id[sid].num_tokens,
                   detail=detail(row=row)))
    if d.needs_acceptance or d.added or d.moved:
        emit(Event("source_changed", detail=detail(source=source, **d.summary())))


# -- skip ---------------------------------------------------------------------------------------------------


@dataclass
class SkipReport:
    changed: list[str] = field(default_factory=list)  # skipped (or brought back) now
    unchanged: list[str] = field(default_factory=list)  # already in the state asked for


def skip_samples(build: str | Path, ids: Sequence[str], note: str, undo: bool = False) -> SkipReport:
    """Retire `ids` (reason `skipped`), or with `undo` bring skipped ones back as pending. Takes the build lock
    (refused while a run or sweep owns the build); unknown ids are refused and nothing is recorded."""
    lay = layout(build).require()
    if not ids:
        raise UsageError("skip: name at least one sample id")
    if not undo and not note.strip():
        raise UsageError("--reason: say why these samples are skipped (it is kept in the log)")
    run_id = uuid.uuid4().hex
    with BuildLock(lay, "skip", run_id), EventLog(lay.events) as log:
        known = current_registry(log)
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise UsageError(f"{', '.join(unknown[:SHOW_IDS])}: no such sample id in {lay.root} (ids are the "
                             f"source's `id` field; list them with: hsbuild sql {lay.root} \"SELECT sample_id, "
                             "state FROM samples\")")
        rep = SkipReport()
        events = []
        for sid in dict.fromkeys(ids):
            cur = known[sid]
            if not undo and cur.state == "retired":
                rep.unchanged.append(sid)
            elif undo and cur.retired_reason != "skipped":
                if cur.state == "retired":
                    raise UsageError(f"{sid}: was removed from the source, not skipped; put its row back and "
                                     f"run `hsbuild resume {lay.root} --accept-source-changes`")
                rep.unchanged.append(sid)
            else:
                rep.changed.append(sid)
                events.append(Event("superseded", run_id=run_id, sample_id=sid, fingerprint=cur.fingerprint,
                                    num_tokens=cur.num_tokens, reason="unskipped",
                                    detail=detail(row=cur.row, note=note or None))
                              if undo else
                              Event("retired", run_id=run_id, sample_id=sid, fingerprint=cur.fingerprint,
                                    reason="skipped", detail=detail(note=note)))
        log.append(events)
    return rep
