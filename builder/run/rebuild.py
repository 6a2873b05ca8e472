"""The log from the data: segments describe themselves (a manifest per durable group), so the event log can be
checked against them and, when it is lost or damaged, rebuilt from them (like restic's `rebuild-index` from
pack headers).

- `unlogged`: groups made durable whose `written` events the log does not hold. A few are normal after a crash
  (the group was durable, the batch with its events never committed); many, or whole runs the log never
  recorded, mean the log lost commits (a deleted or damaged WAL).
- `adopt`: record such samples as written after a full read-back check of their checksums, instead of
  re-extracting them (resume does this).
- `rebuild_log`: a new log from hsbuild.toml, the source and every segment's manifests; the old log is kept
  beside it, renamed.
"""

from __future__ import annotations

import json
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
from builder.store.reader import SegmentReader
from builder.store.segment import SEAL_NAME, list_segments, read_manifests
from builder.verify.checks import check_sample, segment_chunk_tokens
from builder.verify.gc import may_adopt, registered_samples


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


def durable_samples(data_root: Path) -> list[DurableSample]:
    """Every sample recorded in a readable manifest of any segment, in write order."""
    out = []
    for seg in list_segments(data_root):
        for m in read_manifests(data_root / seg):
            for s in m.get("samples", []):
                try:
                    out.append(DurableSample(seg, str(s["sample_id"]), str(s["fingerprint"]), int(s["attempt"]),
                                             int(s["token_start"]), int(s["num_tokens"]), int(s["nbytes"]),
                                             dict(s["checksums"]), float(m.get("written_at", 0.0)),
                                             int(s.get("truncated", 0)),
                                             s["fp8_error"] if isinstance(s.get("fp8_error"), dict) else None))
                except (KeyError, TypeError, ValueError):
                    continue
    return sorted(out, key=lambda d: (d.written_at, d.segment, d.token_start))


def unlogged(log: EventLog, data_root: Path) -> list[DurableSample]:
    """Durable samples whose location no `written` event in the log names."""
    _, rows = log.query("SELECT DISTINCT segment, token_start FROM events WHERE kind = 'written'")
    known = {(r[0], int(r[1])) for r in rows}
    return [d for d in durable_samples(data_root) if (d.segment, d.token_start) not in known]


@dataclass
class AdoptReport:
    adopted: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # durable per manifest, but the bytes fail their check
    stale: int = 0  # another attempt is live, or the source changed since: not adopted


def written_events(d: DurableSample, how: str) -> list[Event]:
    return [
        Event("written", sample_id=d.sample_id, fingerprint=d.fingerprint, attempt=d.attempt, segment=d.segment,
              token_start=d.token_start, num_tokens=d.num_tokens, nbytes=d.nbytes,
              checksums=json.dumps(d.checksums, sort_keys=True),
              detail=detail(**{how: True}, truncated=d.truncated,
                            **({"fp8_error": {k: round(v, 6) for k, v in d.fp8_error.items()}} if d.fp8_error else {}))),
        Event("verified", sample_id=d.sample_id, fingerprint=d.fingerprint, attempt=d.attempt, segment=d.segment,
              token_start=d.token_start, num_tokens=d.num_tokens, nbytes=d.nbytes, detail=detail(mode=how)),
    ]


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
    for d in newest.values():
        ct = segment_chunk_tokens(data_root / d.segment) or 1
        res = check_sample(data_root, d.segment, d.token_start, d.num_tokens, d.checksums, ct, reader)
        if not res.ok:
            rep.damaged.append(d.sample_id)
            continue
        for ev in written_events(d, "adopted"):
            emit(ev)
        rep.adopted.append(d.sample_id)
    return rep


@dataclass
class RebuildReport:
    kept_as: str | None  # the old log's new name, if there was one
    segments: int = 0
    samples: int = 0  # samples recorded written
    registered: int = 0
    skipped: int = 0  # manifest entries not matching the source (other fingerprint / unknown id)
    layout1_segments: int = 0  # segments without manifests (written before layout 2): their samples are redone


def rebuild_log(build: str | Path, make_meta: Callable[[BuildLayout], dict],
                load_samples: Callable[[BuildLayout], list]) -> RebuildReport:
    """Replace the build's event log by one rebuilt from hsbuild.toml, the source and the segments' manifests.
    `make_meta` gives the build metadata (model, layers, fingerprints) and `load_samples` the source's samples,
    as `init` computes them. The old log is renamed, never deleted."""
    lay = layout(build)
    if not lay.config.is_file():
        raise UsageError(f"{lay.root}: no hsbuild.toml; the log cannot be rebuilt without the build's config "
                         "(restore it, or start again with `hsbuild init`)")
    with BuildLock(lay, "rebuild-log"):
        meta = make_meta(lay)
        samples = load_samples(lay)
        kept_as = None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for p in (lay.events, lay.wal):
            if p.exists():
                dest = p.with_name(f"{p.name}.damaged-{stamp}")
                os.replace(p, dest)
                kept_as = kept_as or dest.name
        fsync_path(lay.root)
        rep = RebuildReport(kept_as)
        with EventLog(lay.events) as log:
            log.set_meta(meta)
            rep.registered = len(samples)
            log.register_samples(samples)
            known = {s.sample_id: s.fingerprint for s in samples}
            newest: dict[str, DurableSample] = {}
            for d in durable_samples(lay.data):
                if known.get(d.sample_id) != d.fingerprint:
                    rep.skipped += 1
                    continue
                newest[d.sample_id] = d
            events = [Event("init", run_id="rebuild", detail=detail(rebuilt=True, samples=len(samples)))]
            for d in newest.values():
                ev = written_events(d, "rebuilt")[0]  # written only: `hsbuild verify` reads them back
                ev.run_id = "rebuild"
                events.append(ev)
            segs = list_segments(lay.data)
            rep.segments = len(segs)
            for seg in segs:
                if not read_manifests(lay.data / seg) and not (lay.data / seg / "samples").is_dir():
                    rep.layout1_segments += 1
                if (lay.data / seg / SEAL_NAME).is_file():
                    events.append(Event("segment_sealed", run_id="rebuild", segment=seg,
                                        detail=detail(rebuilt=True)))
            rep.samples = len(newest)
            events.append(Event("log_rebuilt", run_id="rebuild", detail=detail(
                kept_as=kept_as, segments=rep.segments, samples=rep.samples, skipped=rep.skipped,
                layout1_segments=rep.layout1_segments)))
            log.append(events)
        return rep
