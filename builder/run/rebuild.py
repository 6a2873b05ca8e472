"""The log from the data: segments describe themselves (a manifest per durable group), so the event log can be
checked against them and, when it is lost or damaged, rebuilt from them (like restic's `rebuild-index` from
pack headers).

- `unlogged`: groups made durable whose `written` events the log does not hold. A few are normal after a crash
  (the group was durable, the batch with its events never committed); many, or whole runs the log never
  recorded, mean the log lost commits (a deleted or damaged WAL).
- `adopt`: record such samples as written after a full read-back check of their checksums, instead of
  re-extracting them (resume does this).
- `rebuild_log`: a new log from hsbuild.toml, the source, every segment's manifests and the build's history
  records (data/history/: runs, skips, verify verdicts, dropped responses), replayed in write order and read back
  (builder/run/history_replay.py); the old log is kept beside it, renamed.

Write order: a run's ordinal (its history record, builder/store/history.py), then the attempt (a run numbers a
sample's attempts upward), then the token (a segment's writer only moves forward). Never the wall clock, which
may jump back; only segments of runs without a record (a build made before history records) fall back to their
manifests' `written_at`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import UsageError
from builder.fsutil import fsync_path
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.lock import BuildLock
from builder.progress import Progress
from builder.run.handling import AT_TOKEN_LIMIT, drop_event
from builder.run.history_replay import (
    RUN_ID,
    DurableSample,
    ReplayReport,
    disk_shares,
    read_back,
    replay,
    tally,
    written_events,
)
from builder.store.history import read_history, record_names, run_ordinals, segment_run
from builder.store.readback import check_sample, segment_chunk_tokens
from builder.store.reader import SegmentReader
from builder.store.segment import MANIFEST_DIR, SEAL_NAME, list_segments, read_manifests
from builder.verify.gc import may_adopt, registered_samples


def durable_samples(data_root: Path) -> list[DurableSample]:
    """Every sample recorded in a readable manifest of any segment, in write order."""
    out = []
    ordinals = run_ordinals(data_root)
    for seg in list_segments(data_root):
        ordinal = ordinals.get(segment_run(seg), 0)
        for m in read_manifests(data_root / seg):
            group = _group(m)
            for s in m.get("samples", []):
                try:
                    out.append(DurableSample(seg, str(s["sample_id"]), str(s["fingerprint"]), int(s["attempt"]),
                                             int(s["token_start"]), int(s["num_tokens"]), int(s["nbytes"]),
                                             dict(s["checksums"]), float(m.get("written_at", 0.0)),
                                             int(s.get("truncated", 0)),
                                             s["fp8_error"] if isinstance(s.get("fp8_error"), dict) else None,
                                             ordinal,
                                             s["generation"] if isinstance(s.get("generation"), dict) else None,
                                             *group))
                except (KeyError, TypeError, ValueError):
                    continue
    return sorted(out, key=lambda d: d.order)


def _group(m: dict) -> tuple[int, int, int]:
    """A manifest's group: where its shards start, the tokens its samples span from there, their bytes (0, 0, 0
    when it cannot say)."""
    try:
        start = int(m.get("group_start", 0))
        samples = m.get("samples", [])
        end = max(int(s["token_start"]) + int(s["num_tokens"]) for s in samples)
        return start, end - start, sum(int(s["nbytes"]) for s in samples)
    except (KeyError, TypeError, ValueError):
        return 0, 0, 0


def unlogged(log: EventLog, data_root: Path) -> list[DurableSample]:
    """Durable samples whose location no `written` event in the log names."""
    _, rows = log.query("SELECT DISTINCT segment, token_start FROM events WHERE kind = 'written'")
    known = {(r[0], int(r[1])) for r in rows}
    return [d for d in durable_samples(data_root) if (d.segment, d.token_start) not in known]


def unlogged_drops(log: EventLog, data_root: Path) -> list[Event]:
    """The `retired` events the log lacks of responses dropped with --drop-truncated (a run killed between a
    `drop` history record and its events' commit): each entry of a drop record that no `retired` event naming
    that record holds, whose sample is registered with the entry's fingerprint and not done (written, verified,
    retired). A sample once dropped is thereby never generated again."""
    names = record_names(data_root, "drop")
    if not names:
        return []
    _, rows = log.query("SELECT sample_id, json_extract_string(detail, '$.record') FROM events "
                        "WHERE kind = 'retired' AND reason = ?", [AT_TOKEN_LIMIT])
    logged = {(r[0], r[1]) for r in rows}
    # (a record's events commit together: only a record the log never names is read)
    records = read_history(data_root, ("drop",), set(names) - {r[1] for r in rows})
    missed = [(r.name, x) for r in records for x in r.body.get("samples", [])
              if (str(x.get("sample_id")), r.name) not in logged]
    if not missed:
        return []
    _, rows = log.query("SELECT sample_id, fingerprint, state FROM samples WHERE sample_id IN (SELECT unnest(?))",
                        [sorted({str(x.get("sample_id")) for _, x in missed})])
    now = {r[0]: (r[1], r[2]) for r in rows}
    out = []
    for name, x in missed:
        sid, fp = str(x.get("sample_id")), x.get("fingerprint")
        fp_now, state = now.get(sid, (None, None))
        if fp_now == fp and state not in ("written", "verified", "retired"):
            out.append(drop_event(sid, fp, x.get("attempt"), dict(x.get("generation") or {}), name, adopted=True))
            now[sid] = (fp_now, "retired")
    return out


@dataclass
class AdoptReport:
    adopted: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # durable per manifest, but the bytes fail their check
    stale: int = 0  # another attempt is live, or the source changed since: not adopted


def adopt(log: EventLog, data_root: Path, emit: Callable[[Event], None],
          candidates: list[DurableSample] | None = None) -> AdoptReport:
    """Record as written (and verified) each durable sample the log missed whose sample is registered with the
    same fingerprint and not already done, once a full read-back matches its checksums. The newest durable
    attempt of a sample wins."""
    rep = AdoptReport()
    candidates = unlogged(log, data_root) if candidates is None else candidates
    if not candidates:
        return rep
    registered = registered_samples(log)
    newest: dict[str, DurableSample] = {}
    for d in candidates:
        if not may_adopt(d.sample_id, d.fingerprint, registered):  # (the rule gc keeps groups by)
            rep.stale += 1
            continue
        newest[d.sample_id] = d  # candidates are in write order: the last one wins
    rep.stale += len(candidates) - rep.stale - len(newest)
    reader = SegmentReader(data_root)
    disk = disk_shares(data_root, newest.values())
    for d in newest.values():
        ct = segment_chunk_tokens(data_root / d.segment) or 1
        res = check_sample(data_root, d.segment, d.token_start, d.num_tokens, d.checksums, ct, reader)
        if not res.ok:
            rep.damaged.append(d.sample_id)
            continue
        for ev in written_events(d, "adopted", disk.get((d.segment, d.token_start))):
            emit(ev)
        rep.adopted.append(d.sample_id)
    return rep


@dataclass
class RebuildReport:
    kept_as: str | None  # the old log's new name, if there was one
    segments: int = 0
    registered: int = 0
    layout1_segments: int = 0  # segments without manifests (written before layout 2): their samples are redone
    history: ReplayReport = field(default_factory=ReplayReport)

    @property
    def pending(self) -> int:
        """Registered samples the rebuilt log gives no state (no durable data, or brought back by --undo)."""
        h = self.history
        return self.registered - h.written - h.skipped - h.dropped - h.failed


def rebuild_log(build: str | Path, make_meta: Callable[[BuildLayout], dict],
                load_samples: Callable[[BuildLayout], list], progress: Progress | None = None,
                jobs: int | None = None) -> RebuildReport:
    """Replace the build's event log by one rebuilt from hsbuild.toml, the source, the segments' manifests and
    the build's history records, and read back every sample it restores as written. `make_meta` gives the build
    metadata (model, layers, fingerprints) and `load_samples` the source's samples, as `init` computes them.
    The old log is renamed, never deleted. A damaged history record is refused (UsageError naming it) before
    anything changes."""
    lay = layout(build)
    if not lay.config.is_file():
        raise UsageError(f"{lay.root}: no hsbuild.toml; the log cannot be rebuilt without the build's config "
                         "(restore it, or start again with `hsbuild init`)")
    with BuildLock(lay, "rebuild-log"):
        meta = make_meta(lay)
        samples = load_samples(lay)
        records = read_history(lay.data)  # (refused here, before the old log is moved, when one is damaged)
        rep = RebuildReport(None)
        source = {s.sample_id: s for s in samples}
        entries = durable_samples(lay.data)
        events, states = replay(entries, records, source, rep.history, disk_shares(lay.data, entries))
        events += read_back(lay.data, states, rep.history, jobs, progress)
        tally(states, rep.history)
        rep.registered = len(samples)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for p in (lay.events, lay.wal):
            if p.exists():
                dest = p.with_name(f"{p.name}.damaged-{stamp}")
                os.replace(p, dest)
                rep.kept_as = rep.kept_as or dest.name
        fsync_path(lay.root)
        with EventLog(lay.events) as log:
            log.set_meta(meta)
            log.register_samples(samples)
            segs = list_segments(lay.data)
            rep.segments = len(segs)
            sealed = []
            for seg in segs:
                if not (lay.data / seg / MANIFEST_DIR).is_dir():
                    rep.layout1_segments += 1
                if (lay.data / seg / SEAL_NAME).is_file():
                    sealed.append(Event("segment_sealed", run_id=RUN_ID, segment=seg, detail=detail(rebuilt=True)))
            h = rep.history
            log.append([Event("init", run_id=RUN_ID, detail=detail(rebuilt=True, samples=len(samples))), *events,
                        *sealed, Event("log_rebuilt", run_id=RUN_ID, detail=detail(
                            kept_as=rep.kept_as, segments=rep.segments, layout1_segments=rep.layout1_segments,
                            records=dict(h.records), written=h.written, verified=h.verified, skipped=h.skipped,
                            dropped=h.dropped, failed=h.failed, failed_by_verify=h.failed_by_verify,
                            older_attempts=h.older_attempts,
                            foreign=h.foreign, stale=h.stale, read_back=h.read_back, read_bytes=h.read_bytes,
                            damaged=[sid for sid, _ in h.damaged][:1000],
                            not_checked=[sid for sid, _ in h.not_checked][:1000]))])
        return rep
