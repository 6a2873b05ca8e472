"""`rebuild-log`'s replay (docs/design.md section 11): the segments' manifests and the build's history records
(data/history/, builder/store/history.py) merged in write order into the events that bring each sample back to
the state the lost log gave it, then every sample restored as written read back against its checksums.

What comes back, and what cannot (the log alone held it):
- written: the newest durable attempt of each sample, in write order (a run's ordinal, then the attempt), every
  older durable attempt before it as a superseded `written` (its bytes stay referenced, as they were), each
  with what its manifest entry holds (a regenerated sample's generation figures) and its share of its group's
  blocks on disk, measured again (`disk_shares`);
- skipped (`hsbuild skip`) and brought back (`--undo`): from their records;
- responses dropped at the token limit (--drop-truncated): retired `at_token_limit` with their figures
  (generated, finish_reason, seed, turns), from the runs' `drop` records;
- verified, and failed by a sweep (checksum_mismatch, missing_data, unreadable): from the sweeps' records, each
  verdict applied only to the location it judged, and only while that is still the sample's current one;
- not restored: failures a run recorded (a failed sample without newer durable data comes back pending and is
  tried again), samples left in flight, attempt counts (they restart), a verification by --verify-after-write
  or by a run's adoption (those samples come back written; rebuild-log has just read them back), samples removed
  from the source (the rebuilt log registers the source as it is now), and the runs', sweeps', exports' and gc's
  own events. Event times are the rebuild's.

Then the read-back: a sample restored as written (or verified) whose bytes fail their check is recorded
`failed` with the verify reason (resume extracts it again); one whose check could not run (EIO, EMFILE, ...)
stays written with a `check_error` event, and is named. Nothing here prints.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from builder.errors import UsageError
from builder.log.events import Event, detail
from builder.progress import NoProgress, Progress
from builder.run.handling import drop_event
from builder.store.history import LOST_RECORD, VERDICTS, HistoryRecord
from builder.store.readback import SharedReader, check_sample, check_with_retries, segment_chunk_tokens
from builder.store.segment import DIMS, FIELDS, MANIFEST_DIR, field_geometry
from builder.store.shard import ShardGeometry, shard_path

RUN_ID = "rebuild"  # the run id of every event rebuild-log writes


class SourceRow(Protocol):
    sample_id: str
    row: int
    fingerprint: str

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class DurableSample:
    """One sample as a segment's manifest records it."""

    segment: str
    sample_id: str
    fingerprint: str
    attempt: int
    token_start: int
    num_tokens: int
    nbytes: int
    checksums: dict
    written_at: float
    truncated: int = 0
    fp8_error: dict | None = None  # an fp8 build: the measured error, as its `written` event records it
    ordinal: int = 0  # the ordinal of the run that wrote it (its history record); 0: a run without one
    generation: dict | None = None  # a regenerated sample: generated, finish_reason, seed, turns (its manifest's)
    group_start: int = 0  # its group (manifest): where its shards start, the tokens and bytes its samples hold
    group_tokens: int = 0
    group_nbytes: int = 0

    @property
    def order(self) -> tuple:
        """Its place in write order (the module's docstring); a run without a record comes first, by clock."""
        if self.ordinal:
            return (self.ordinal, self.attempt, 0.0, self.segment, self.token_start)
        return (0, 0, self.written_at, self.segment, self.token_start)


@dataclass
class ReplayReport:
    written: int = 0  # samples restored written or verified, their bytes read back good (or not readable)
    verified: int = 0  # of them, verified by a sweep's record
    skipped: int = 0  # retired as skipped
    dropped: int = 0  # retired at the token limit (--drop-truncated)
    failed: int = 0  # failed: by a sweep's record, or damaged when read back
    failed_by_verify: int = 0  # verdicts `failed` a sweep's record applied
    older_attempts: int = 0  # durable attempts superseded by a newer one (restored as superseded `written`)
    foreign: int = 0  # manifest entries not in the source (another fingerprint, or an id it no longer has)
    stale: int = 0  # record entries that no longer apply (the source changed, the location was superseded)
    records: Counter = field(default_factory=Counter)  # history records replayed, per kind
    read_back: int = 0  # samples read back
    read_bytes: int = 0  # their compressed bytes
    good: int = 0
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (sample_id, reason): recorded failed
    not_checked: list[tuple[str, str]] = field(default_factory=list)  # (sample_id, error): left written


@dataclass
class _State:
    kind: str  # written | retired | pending | failed
    loc: DurableSample | None = None
    verified: bool = False
    dropped: bool = False  # retired at the token limit (a `drop` record), not skipped


def replay(entries: list, records: list[HistoryRecord], source: Mapping[str, SourceRow],
           rep: ReplayReport, disk: Mapping[tuple[str, int], int] | None = None
           ) -> tuple[list[Event], dict[str, _State]]:
    """The events of the history, in order: `entries` (manifest entries, each with `order`, its place in write
    order) and `records` merged by ordinal; `disk`: each entry's share of its group's blocks (`disk_shares`).
    Returns the events and each sample's state after them."""
    timeline: list[tuple[tuple, object]] = [(d.order, d) for d in entries]
    rep.records.update(r.kind for r in records)
    timeline += [((r.ordinal, -1, 0.0, "", 0), r) for r in records if r.kind != "run"]  # (runs: their ordinals)
    timeline.sort(key=lambda x: x[0])
    at_loc: dict[tuple[str, int], str] = {}
    states: dict[str, _State] = {}
    events: list[Event] = []
    seen: set[str] = set()
    for _, item in timeline:
        if isinstance(item, HistoryRecord):
            try:
                events += _apply_record(item, source, states, at_loc, rep)
            except (AttributeError, TypeError, ValueError) as e:
                raise UsageError(f"data/history/{item.name}: a damaged {item.kind} history record "
                                 f"({type(e).__name__}: {e}); restore it from a backup, or move it out of the build's data/history/ to "
                                 f"rebuild without it ({LOST_RECORD[item.kind]})") from None
            continue
        d = item
        reg = source.get(d.sample_id)
        if reg is None or reg.fingerprint != d.fingerprint:
            rep.foreign += 1
            continue
        if d.sample_id in seen:
            rep.older_attempts += 1
        seen.add(d.sample_id)
        events.append(written_event(d, (disk or {}).get((d.segment, d.token_start))))
        states[d.sample_id] = _State("written", d)
        at_loc[(d.segment, d.token_start)] = d.sample_id
    return events, states


def tally(states: dict[str, _State], rep: ReplayReport) -> None:
    """The samples per state the rebuilt log gives (after the read-back)."""
    rep.written = sum(st.kind == "written" for st in states.values())
    rep.verified = sum(st.kind == "written" and st.verified for st in states.values())
    rep.skipped = sum(st.kind == "retired" and not st.dropped for st in states.values())
    rep.dropped = sum(st.kind == "retired" and st.dropped for st in states.values())
    rep.failed = sum(st.kind == "failed" for st in states.values())


def disk_shares(data_root: Path, entries: Iterable[DurableSample]) -> dict[tuple[str, int], int]:
    """Each sample's share of what its group occupies on disk (the allocated blocks of its shard files and its
    manifest, shared in proportion to the samples' bytes), as its writer counted it for its `written` event's
    `disk_bytes` (`SegmentWriter.commit`), by (segment, token_start); the capacity projection measures bytes
    per token from it. A group whose files cannot be found is left out."""
    out: dict[tuple[str, int], int] = {}
    geometry: dict[str, list | None] = {}
    allocated: dict[tuple[str, int], int | None] = {}
    for d in entries:
        if d.group_nbytes <= 0:
            continue
        seg_dir = data_root / d.segment
        if d.segment not in geometry:
            try:
                geometry[d.segment] = [(f, ShardGeometry(*field_geometry(seg_dir, f))) for f in FIELDS]
            except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError):
                geometry[d.segment] = None
        geo = geometry[d.segment]
        key = (d.segment, d.group_start)
        if key not in allocated:
            allocated[key] = None if geo is None else _allocated(
                [seg_dir / MANIFEST_DIR / f"{d.group_start}.json",
                 *(shard_path(seg_dir, f, DIMS[f], i) for f, g in geo if g.shard_chunks
                   for i in g.shards(d.group_start, d.group_tokens))])
        if allocated[key] is not None:
            out[(d.segment, d.token_start)] = allocated[key] * d.nbytes // d.group_nbytes
    return out


def _allocated(paths: list[Path]) -> int | None:
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_blocks * 512
        except OSError:
            return None  # (a file gone: no share to give)
    return total


def written_events(d: DurableSample, how: str, disk_bytes: int | None = None) -> list[Event]:
    """A durable sample recorded: `written` (detail {how: true}, and its share of its group's blocks on disk
    where known), then `verified` (what adoption records)."""
    return [
        Event("written", sample_id=d.sample_id, fingerprint=d.fingerprint, attempt=d.attempt, segment=d.segment,
              token_start=d.token_start, num_tokens=d.num_tokens, nbytes=d.nbytes,
              checksums=json.dumps(d.checksums, sort_keys=True),
              detail=detail(**{how: True}, truncated=d.truncated,
                            **({"disk_bytes": disk_bytes} if disk_bytes is not None else {}),
                            **({"fp8_error": {k: round(v, 6) for k, v in d.fp8_error.items()}}
                               if d.fp8_error else {}), **(d.generation or {}))),
        Event("verified", sample_id=d.sample_id, fingerprint=d.fingerprint, attempt=d.attempt, segment=d.segment,
              token_start=d.token_start, num_tokens=d.num_tokens, nbytes=d.nbytes, detail=detail(mode=how)),
    ]


def written_event(d: DurableSample, disk_bytes: int | None = None) -> Event:
    ev = written_events(d, "rebuilt", disk_bytes)[0]  # written only: a verification comes from a sweep's record
    ev.run_id = RUN_ID
    return ev


def _loc(d: DurableSample) -> dict:
    return {"sample_id": d.sample_id, "fingerprint": d.fingerprint, "attempt": d.attempt, "segment": d.segment,
            "token_start": d.token_start, "num_tokens": d.num_tokens}


def _apply_record(r: HistoryRecord, source: Mapping[str, SourceRow], states: dict[str, _State],
                  at_loc: dict[tuple[str, int], str], rep: ReplayReport) -> list[Event]:
    out: list[Event] = []
    if r.kind in ("skip", "unskip"):
        for x in r.body.get("samples", []):
            sid, fp, note = str(x.get("sample_id")), x.get("fingerprint"), x.get("note")
            reg, st = source.get(sid), states.get(sid, _State("pending"))
            if reg is None or reg.fingerprint != fp:  # the source changed since: that change superseded it
                rep.stale += 1
            elif r.kind == "skip":
                out.append(Event("retired", run_id=RUN_ID, sample_id=sid, fingerprint=fp, reason="skipped",
                                 detail=detail(note=note, rebuilt=True, record=r.name)))
                states[sid] = _State("retired", st.loc)
            elif st.kind == "retired":
                out.append(Event("superseded", run_id=RUN_ID, sample_id=sid, fingerprint=fp,
                                 num_tokens=reg.num_tokens, reason="unskipped",
                                 detail=detail(row=reg.row, note=note, rebuilt=True, record=r.name)))
                states[sid] = _State("pending")
            else:
                rep.stale += 1
        return out
    if r.kind == "drop":  # responses retired at the token limit (--drop-truncated)
        for x in r.body.get("samples", []):
            sid, fp = str(x.get("sample_id")), x.get("fingerprint")
            reg, st = source.get(sid), states.get(sid, _State("pending"))
            if reg is None or reg.fingerprint != fp:  # the source changed since: that change superseded it
                rep.stale += 1
                continue
            out.append(drop_event(sid, fp, x.get("attempt"), dict(x.get("generation") or {}), r.name,
                                  run_id=RUN_ID, rebuilt=True))
            states[sid] = _State("retired", st.loc, dropped=True)
        return out
    if r.kind == "verify":
        for segment, by_verdict in sorted(r.body.get("verdicts", {}).items()):
            for verdict, starts in sorted(by_verdict.items()):
                for start in starts:
                    sid = at_loc.get((segment, int(start)))
                    st = states.get(sid) if sid is not None else None
                    if (verdict not in VERDICTS or st is None or st.kind != "written" or st.loc is None
                            or (st.loc.segment, st.loc.token_start) != (segment, int(start))):
                        rep.stale += 1  # a location since superseded (or retired, or not in the source)
                        continue
                    if verdict == "verified":
                        out.append(Event("verified", run_id=RUN_ID, **_loc(st.loc), detail=detail(
                            mode="sweep", sweep=r.ident, rebuilt=True, record=r.name)))
                        st.verified = True
                    else:
                        out.append(Event("failed", run_id=RUN_ID, reason=verdict, **_loc(st.loc), detail=detail(
                            mode=r.body.get("mode"), sweep=r.ident, rebuilt=True, record=r.name,
                            message=f"found by verify sweep {r.ident[:8]} (history record {r.name})")))
                        states[sid] = _State("failed")
                        rep.failed_by_verify += 1
    return out


def read_back(data_root: Path, states: dict[str, _State], rep: ReplayReport, jobs: int | None = None,
              progress: Progress | None = None) -> list[Event]:
    """Read back every sample the replay restored as written (verified ones too) against its checksums; the
    events for what the reading found (`failed` with the verify reason, `check_error`)."""
    live = sorted((st.loc for st in states.values() if st.kind == "written" and st.loc is not None),
                  key=lambda d: (d.segment, d.token_start))
    reader = SharedReader(data_root)
    chunk_tokens: dict[str, int] = {}
    for d in live:
        if d.segment not in chunk_tokens:
            chunk_tokens[d.segment] = segment_chunk_tokens(data_root / d.segment) or 1

    def check(d: DurableSample):
        return check_with_retries(lambda: check_sample(data_root, d.segment, d.token_start, d.num_tokens,
                                                       d.checksums, chunk_tokens[d.segment], reader))

    bar = progress or NoProgress()
    bar.start(len(live), "rebuild-log: reading back")
    out: list[Event] = []
    try:
        with ThreadPoolExecutor(jobs or max(1, min(4, os.cpu_count() or 1)),
                                thread_name_prefix="hsbuild-rebuild") as pool:
            for d, res in zip(live, pool.map(check, live), strict=True):
                rep.read_back += 1
                rep.read_bytes += res.file_bytes
                bar.update(1, d.num_tokens, res.file_bytes)
                if res.error is not None:
                    rep.not_checked.append((d.sample_id, res.error))
                    out.append(Event("check_error", run_id=RUN_ID, reason="check_error", **_loc(d),
                                     detail=detail(mode="rebuilt", message=res.error)))
                elif res.finding is not None:
                    reason, message = res.finding
                    rep.damaged.append((d.sample_id, reason))
                    out.append(Event("failed", run_id=RUN_ID, reason=reason, **_loc(d),
                                     detail=detail(mode="rebuilt", message=message)))
                    states[d.sample_id] = _State("failed")
                else:
                    rep.good += 1
    finally:
        bar.close()
    return out
