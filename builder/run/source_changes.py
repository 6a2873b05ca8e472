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
{note}); `--undo` brings them back (`superseded`, change `unskipped`). Each writes a history record under
data/history/ (builder/store/history.py) before its events commit, so a rebuilt log keeps them.
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
from builder.log.session import OwnerSession
from builder.run.handling import AT_TOKEN_LIMIT
from builder.store.history import write_record

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
    pos: dict[str, int] = field(default_factory=dict)  # where each sample named above (but removed) is in the source

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


DIFF_SQL = """
SELECT s.pos, s.sample_id, s.row_idx,
       k.sample_id IS NULL AS added,
       coalesce(k.retired_reason = 'removed_from_source', false) AS returned,
       coalesce(k.fingerprint <> s.fingerprint, false) AS changed
FROM _diff_source s LEFT JOIN samples k ON k.sample_id = s.sample_id
WHERE k.sample_id IS NULL OR k.retired_reason = 'removed_from_source' OR k.fingerprint <> s.fingerprint
   OR k.row_idx <> s.row_idx
ORDER BY s.pos
"""
REMOVED_SQL = """
SELECT k.sample_id FROM samples k
WHERE k.state <> 'retired' AND k.sample_id NOT IN (SELECT sample_id FROM _diff_source)
ORDER BY k.row_idx, k.sample_id
"""


def diff_source(log: EventLog, samples: Sequence[Sample]) -> SourceDiff:
    """The source against the registry, by sample id, in one join in DuckDB (a source's columns, not an object
    a sample: a million unchanged samples cost a join, not a million lookups). `pos` keeps where each sample
    the diff names sits in `samples`."""
    import numpy as np  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415

    columns = getattr(samples, "registry_columns", None)
    if columns is not None:
        cols = columns()
        table = pa.table({"sample_id": cols["sample_id"], "row_idx": cols["row_idx"],
                          "fingerprint": cols["fingerprint"]})
    else:
        table = pa.table({"sample_id": pa.array([x.sample_id for x in samples], pa.string()),
                          "row_idx": pa.array([x.row for x in samples], pa.int64()),
                          "fingerprint": pa.array([x.fingerprint for x in samples], pa.string())})
    table = table.append_column("pos", pa.array(np.arange(table.num_rows), pa.int64()))
    cur = log.con.cursor()
    try:
        cur.register("_diff_source", table)
        diff_rows = cur.execute(DIFF_SQL).fetchall()
        removed = [r[0] for r in cur.execute(REMOVED_SQL).fetchall()]
    finally:
        cur.close()
    d = SourceDiff(removed=removed)
    for pos, sid, row, added, returned, changed in diff_rows:
        d.pos[sid] = int(pos)
        if added:
            d.added.append(sid)
        elif returned:
            d.returned.append(sid)
        elif changed:
            d.changed.append(sid)
        else:
            d.moved[sid] = int(row)
    return d


def refusal(d: SourceDiff, build: Path | str) -> SourceChangedError:
    return SourceChangedError(
        f"source changed under the build: {d.describe()}; to accept it run `hsbuild resume {build} "
        "--accept-source-changes` (changed samples are extracted again, removed ones retired, the rest kept), "
        "or restore the original source")


def record_source(log: EventLog, samples: Sequence[Sample], d: SourceDiff, emit, source: str) -> None:
    """Register the new samples and emit the events of an accepted change (`emit` commits them in order)."""
    def by_id(sid: str) -> Sample:
        return samples[d.pos[sid]]

    again = d.changed + d.returned
    old_fp = dict(log.query("SELECT sample_id, fingerprint FROM samples WHERE sample_id IN (SELECT unnest(?))",
                            [again])[1]) if again else {}
    log.register_samples([by_id(sid) for sid in d.added])
    for sid in d.changed + d.returned:
        s = by_id(sid)
        emit(Event("superseded", sample_id=sid, fingerprint=s.fingerprint, num_tokens=s.num_tokens,
                   reason="source_changed" if sid in d.changed else "returned",
                   detail=detail(row=s.row, old_fingerprint=old_fp[sid])))
    for sid in d.removed:
        emit(Event("retired", sample_id=sid, reason="removed_from_source",
                   detail=detail(note="no longer in the source")))
    for sid, row in d.moved.items():
        s = by_id(sid)
        emit(Event("row_moved", sample_id=sid, fingerprint=s.fingerprint, num_tokens=s.num_tokens,
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
    with OwnerSession(lay, "skip", run_id, signals=False) as session:
        log = session.open()
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
                    raise UsageError(_not_skipped(sid, cur.retired_reason, lay.root))
                rep.unchanged.append(sid)
            else:
                rep.changed.append(sid)
                events.append(Event("superseded", run_id=run_id, sample_id=sid, fingerprint=cur.fingerprint,
                                    num_tokens=cur.num_tokens, reason="unskipped",
                                    detail=detail(row=cur.row, note=note or None))
                              if undo else
                              Event("retired", run_id=run_id, sample_id=sid, fingerprint=cur.fingerprint,
                                    reason="skipped", detail=detail(note=note)))
        if events:  # the history beside the data first (write-once), then the log: a lost log loses no skip
            write_record(lay.data, "unskip" if undo else "skip", run_id, {"samples": [
                {"sample_id": ev.sample_id, "fingerprint": ev.fingerprint, "note": note or None} for ev in events]})
        log.append(events)
    return rep


def _not_skipped(sid: str, reason: str | None, root: Path) -> str:
    """Why `skip --undo` cannot bring back `sid`, retired for `reason` (not a skip), and what would."""
    if reason == AT_TOKEN_LIMIT:
        return (f"{sid}: was retired by --drop-truncated (its response stopped at the token limit), not skipped; "
                "`skip --undo` brings back skipped samples only, and its seeds would give the same response again: "
                "to keep such responses, init a build without --drop-truncated or with a larger --max-new-tokens")
    if reason == "removed_from_source":
        return (f"{sid}: was removed from the source, not skipped; put its row back and "
                f"run `hsbuild resume {root} --accept-source-changes`")
    return f"{sid}: was retired ({reason}), not skipped; `skip --undo` brings back skipped samples only"
