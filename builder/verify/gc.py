"""Orphans: bytes in a build that no committed `written` event references and no run would adopt, and
`hsbuild gc`, which removes them.

Crashed writers leave them: shard files (and chunk files, in layout 1 segments) in ranges no `written` event
covers and no manifest vouches for (a group torn before its manifest was durable), manifests none of whose
samples is logged or adoptable, whole segments that hold neither, Zarr's `*.<uuid>.partial` temp files and
hsbuild's `.*.<pid>.tmp` temp files. A segment's metadata (zarr.json, seal.json) belongs to it while any
`written` event references the segment or any group in it is adoptable. Bytes that a superseded `written` still
references (a sample verify found damaged and resume re-extracted elsewhere) are kept; they are not orphans.

**Adoptable groups are never orphans** (docs/design.md section 11): a group made durable whose `written` events
never committed (a crash between the data barrier and the log's commit, a lost or rolled-back WAL, a full disk
that stopped the log) is what the next run reads back and records `written` instead of extracting it again.
gc keeps every group whose manifest lists a sample the run would adopt (registered with the same fingerprint,
not written, verified or retired: `run.rebuild.adopt`'s rule), whole (manifest and every shard of it), and
reports them (`OrphanReport.adoptable`) with the command that adopts them, `hsbuild resume BUILD`. Once the run
has adopted them they are referenced; once their samples are done from other bytes they are orphans.

The build's history records (data/history/, builder/store/history.py) are never orphans: they hold what a
rebuilt log needs (runs, skips, verify verdicts) and are never removed; only a temp file a crash left beside
them is reclaimable.

Only a process holding the build lock may scan: otherwise a live writer's uncommitted chunks would look
orphaned. `scan_orphans` reports, `remove_orphans` deletes exactly what a scan reported; neither prints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from builder.config import load_config
from builder.errors import DiskFullError
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.kinds import EventKind
from builder.log.session import OwnerSession
from builder.store.history import history_dir
from builder.store.segment import DIMS, FIELDS, MANIFEST_DIR, MANIFEST_FORMAT, field_geometry, list_segments
from builder.store.shard import ShardGeometry, shard_path
from builder.verify.targets import fetch

PARTIAL_RE = re.compile(r".+\.[0-9a-f]{32}\.partial$")  # zarr LocalStore: path.with_suffix(".<uuid4>.partial")
TMP_RE = re.compile(r"^\..+\.\d+\.tmp$")  # fsutil.atomic_write_bytes: .<name>.<pid>.tmp
ONE_D = {"input_ids", "loss_mask"}
DONE_STATES = ("written", "verified", "retired")  # a sample in one of these is never adopted (`may_adopt`)


@dataclass
class Orphan:
    path: str  # relative to the build root
    kind: str  # segment | shard | manifest | chunk (layout 1) | partial | tmp
    nbytes: int
    files: int = 1


@dataclass
class Adoptable:
    """A durable group the log does not list, kept because the next run adopts (some of) its samples."""

    path: str  # its manifest, relative to the build root
    samples: int  # of its samples, those a run would adopt
    nbytes: int  # its manifest and shard files
    files: int


@dataclass
class OrphanReport:
    orphans: list[Orphan] = field(default_factory=list)
    adoptable: list[Adoptable] = field(default_factory=list)  # kept: `hsbuild resume` adopts them

    @property
    def count(self) -> int:
        return len(self.orphans)

    @property
    def files(self) -> int:
        return sum(o.files for o in self.orphans)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.orphans)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(o.kind for o in self.orphans))

    @property
    def adoptable_samples(self) -> int:
        return sum(a.samples for a in self.adoptable)

    def as_dict(self, with_items: bool = False) -> dict:
        d: dict = {"count": self.count, "files": self.files, "bytes": self.nbytes, "by_kind": self.by_kind(),
                   "adoptable": {"groups": len(self.adoptable), "samples": self.adoptable_samples,
                                 "bytes": sum(a.nbytes for a in self.adoptable)}}
        if with_items:
            d["items"] = [o.__dict__ for o in self.orphans]
            d["adoptable"]["items"] = [a.__dict__ for a in self.adoptable]
        return d


def referenced_chunks(log: EventLog) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Token ranges per segment of every committed `written` event (live or superseded): (token_start,
    num_tokens) arrays, in token order."""
    t = fetch(log, "SELECT segment, token_start, num_tokens FROM events "
                   "WHERE kind = 'written' AND segment IS NOT NULL ORDER BY segment, token_start")
    seg = t.column("segment").combine_chunks().dictionary_encode()
    code = np.asarray(seg.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    starts = t.column("token_start").to_numpy().astype(np.int64)
    counts = t.column("num_tokens").to_numpy().astype(np.int64)
    bounds = np.flatnonzero(np.diff(code)) + 1
    out = {}
    for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), len(code)], strict=True):
        if b > a:
            out[seg.dictionary[int(code[a])].as_py()] = (starts[a:b], counts[a:b])
    return out


def _span_indices(starts: np.ndarray, counts: np.ndarray, span: int) -> set[int]:
    """The indices of the `span`-token pieces (chunks, shards) that token ranges (starts, counts) touch."""
    first = starts // span
    last = (starts + np.maximum(counts, 1) - 1) // span
    idx = set(np.unique(first).tolist())
    for a, b in zip(first[last > first].tolist(), last[last > first].tolist(), strict=True):
        idx.update(range(a + 1, b + 1))
    return idx


def _chunk_indices(ranges: tuple[np.ndarray, np.ndarray], chunk_tokens: int) -> set[int]:
    return _span_indices(*ranges, chunk_tokens)


def _size(p: str) -> int:
    try:
        return os.lstat(p).st_size
    except FileNotFoundError:
        return 0


def _is_temp(name: str) -> str | None:
    if PARTIAL_RE.match(name):
        return "partial"
    if TMP_RE.match(name):
        return "tmp"
    return None


def _chunk_orphan(parts: tuple[str, ...], indices: set[int]) -> bool:
    """Is this file (path parts inside a segment) a chunk file outside every referenced range?"""
    if len(parts) < 3 or parts[0] not in FIELDS or parts[1] != "c" or not all(p.isdigit() for p in parts[2:]):
        return False
    if parts[0] in ONE_D:
        return len(parts) == 3 and int(parts[2]) not in indices
    return len(parts) == 4 and (int(parts[2]) not in indices or parts[3] != "0")


def _shard_orphan(parts: tuple[str, ...], shards: set[int]) -> bool:
    """Layout 2: is this file a shard file outside every referenced range?"""
    if len(parts) != 2 or parts[0] not in FIELDS:
        return False
    bits = parts[1].split(".")
    if bits[0] != "c" or not all(b.isdigit() for b in bits[1:]):
        return False
    want = 2 if parts[0] in ONE_D else 3
    return len(bits) != want or int(bits[1]) not in shards or (want == 3 and bits[2] != "0")


def _manifest_orphan(parts: tuple[str, ...], keep: set[str]) -> bool:
    """Layout 2: a group manifest that vouches for nothing committed or adoptable (`keep`: the names of those
    that do)."""
    return len(parts) == 2 and parts[0] == MANIFEST_DIR and parts[1].endswith(".json") and parts[1] not in keep


@dataclass
class _Group:
    name: str  # the manifest's file name
    ranges: list[tuple[int, int]]  # (token_start, num_tokens) of each of its samples
    referenced: bool  # a `written` event names one of its samples
    adoptable: int  # its samples a run would adopt (not referenced: the log does not list them)


def _groups(seg_dir: Path, starts: set[int], registered: dict[str, tuple[str, str]]) -> list[_Group]:
    """The segment's readable manifests, each with what it vouches for. An entry is adoptable as
    `run.rebuild.adopt` takes it: every field a manifest entry has (as `run.rebuild.durable_samples` reads it),
    the sample registered with the same fingerprint, and not done (written, verified) or retired."""
    out = []
    d = seg_dir / MANIFEST_DIR
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        try:
            m = json.loads((d / name).read_bytes())
            entries = list(m["samples"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: vouches for nothing
        known = m.get("format") == MANIFEST_FORMAT  # a run reads (and adopts from) only these (read_manifests)
        g = _Group(name, [], False, 0)
        for x in entries:
            try:
                start, n = int(x["token_start"]), int(x["num_tokens"])
            except (KeyError, TypeError, ValueError):
                continue
            g.ranges.append((start, n))
            if start in starts:
                g.referenced = True
            elif known and _adoptable(x, registered):
                g.adoptable += 1
        out.append(g)
    return out


def _adoptable(x: dict, registered: dict[str, tuple[str, str]]) -> bool:
    try:
        sid, fp = str(x["sample_id"]), str(x["fingerprint"])
        int(x["attempt"]), int(x["nbytes"]), dict(x["checksums"])
    except (KeyError, TypeError, ValueError):
        return False
    return may_adopt(sid, fp, registered)


def may_adopt(sample_id: str, fingerprint: str, registered: dict[str, tuple[str, str]]) -> bool:
    """The adoption rule (gc keeps such a group, `resume` and `rebuild-log` adopt it): a durable sample whose
    sample is registered with this fingerprint (the current one: a source change supersedes it) and not done
    (written, verified or retired)."""
    reg = registered.get(sample_id)
    return reg is not None and reg[0] == fingerprint and reg[1] not in DONE_STATES


class _Registered:
    """`registered_samples`, read only if asked (a build whose manifests list only logged samples never asks)."""

    def __init__(self, log: EventLog):
        self.log = log
        self._map: dict[str, tuple[str, str]] | None = None

    def get(self, sample_id: str) -> tuple[str, str] | None:
        if self._map is None:
            self._map = registered_samples(self.log)
        return self._map.get(sample_id)


def registered_samples(log: EventLog) -> dict[str, tuple[str, str]]:
    """sample_id -> (its current fingerprint, its state), from the `samples` view."""
    _, rows = log.query("SELECT sample_id, fingerprint, state FROM samples")
    return {str(r[0]): (str(r[1]), str(r[2])) for r in rows}


def _scan_segment(seg_dir: Path, indices: set[int] | None, root: Path,
                  sharded: tuple[set[int], set[str]] | None = None) -> list[Orphan]:
    found = []
    for dirpath, _dirs, files in os.walk(seg_dir):
        rel_dir = Path(dirpath).relative_to(seg_dir).parts
        for name in files:
            full = os.path.join(dirpath, name)
            kind = _is_temp(name)
            rel = (*rel_dir, name)
            if kind is None and sharded is not None:
                if _shard_orphan(rel, sharded[0]):
                    kind = "shard"
                elif _manifest_orphan(rel, sharded[1]):
                    kind = "manifest"
            elif kind is None and indices is not None and _chunk_orphan(rel, indices):
                kind = "chunk"
            if kind:
                found.append(Orphan(str(Path(full).relative_to(root)), kind, _size(full)))
    return found


def scan_orphans(lay: BuildLayout, log: EventLog) -> OrphanReport:
    """Everything reclaimable in the build, and the durable groups kept because a run would adopt them. The
    caller must hold the build lock."""
    refs = referenced_chunks(log)
    registered = _Registered(log)
    try:
        default_ct: int | None = load_config(lay).chunk_tokens
    except Exception:  # noqa: BLE001 - without a config, only segment metadata says how chunks map
        default_ct = None
    report = OrphanReport()
    root = lay.root
    for name in sorted(os.listdir(root)) if root.is_dir() else []:
        if TMP_RE.match(name) and (root / name).is_file():
            report.orphans.append(Orphan(name, "tmp", _size(str(root / name))))
    if not lay.data.is_dir():
        return report
    for entry in sorted(os.scandir(lay.data), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False) and (kind := _is_temp(entry.name)):
            report.orphans.append(Orphan(str(Path(entry.path).relative_to(root)), kind, _size(entry.path)))
    hist = history_dir(lay.data)  # the history records are never orphans; a temp file a crash left there is
    for name in sorted(os.listdir(hist)) if hist.is_dir() else []:
        if TMP_RE.match(name) and (hist / name).is_file():
            report.orphans.append(Orphan(str((hist / name).relative_to(root)), "tmp", _size(str(hist / name))))
    for seg in list_segments(lay.data):
        seg_dir = lay.data / seg
        seg_refs = refs.get(seg, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        try:
            ct, sc = field_geometry(seg_dir, "aux_hidden_state")
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            ct, sc = default_ct, 0
        groups = _groups(seg_dir, set(seg_refs[0].tolist()), registered) if sc else []  # type: ignore[arg-type]
        kept = [g for g in groups if g.referenced or g.adoptable]
        if not len(seg_refs[0]) and not any(g.adoptable for g in groups):
            files = [os.path.join(d, f) for d, _, fs in os.walk(seg_dir) for f in fs]
            report.orphans.append(Orphan(str(seg_dir.relative_to(root)), "segment", sum(map(_size, files)),
                                         len(files)))
            continue
        if sc:
            geo = ShardGeometry(ct, sc)
            shards = _span_indices(*seg_refs, geo.shard_tokens)
            ranges = [r for g in kept for r in g.ranges]  # a kept group is kept whole: its manifest, every shard
            if ranges:
                shards |= _span_indices(*np.array(ranges, dtype=np.int64).T, geo.shard_tokens)
            for g in kept:
                if g.adoptable and not g.referenced:
                    own = {i for start, n in g.ranges for i in geo.shards(start, n)}
                    paths = [seg_dir / MANIFEST_DIR / g.name] + [shard_path(seg_dir, f, DIMS[f], i)
                                                                  for f in FIELDS for i in sorted(own)]
                    present = [p for p in paths if p.exists()]
                    report.adoptable.append(Adoptable(str(paths[0].relative_to(root)), g.adoptable,
                                                      sum(_size(str(p)) for p in present), len(present)))
            report.orphans.extend(_scan_segment(seg_dir, None, root, (shards, {g.name for g in kept})))
            continue
        indices = _chunk_indices(seg_refs, ct) if ct else None  # unknown geometry: remove temp files only
        report.orphans.extend(_scan_segment(seg_dir, indices, root))
    return report


def remove_orphans(lay: BuildLayout, report: OrphanReport) -> tuple[int, int]:
    """Delete what `report` lists (and directories left empty inside chunk trees). Returns (files, bytes)."""
    files = nbytes = 0
    for o in report.orphans:
        p = lay.root / o.path
        if o.kind == "segment":
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            _prune_empty_dirs(p.parent, lay.data)
        files += o.files
        nbytes += o.nbytes
    return files, nbytes


def _prune_empty_dirs(d: Path, stop: Path) -> None:
    """Remove now-empty chunk directories (`FIELD/c/<i>/`), never a field's `c/` itself or anything above."""
    while d != stop and stop in d.parents and d.parent.name == "c":
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


@dataclass
class GcReport:
    gc_id: str
    dry_run: bool
    orphans: OrphanReport
    removed_files: int = 0
    removed_bytes: int = 0
    seconds: float = 0.0
    record_error: str | None = None  # the `gc` event could not be committed (a full disk): why

    def as_dict(self) -> dict:
        return {"gc_id": self.gc_id, "dry_run": self.dry_run, "orphans": self.orphans.as_dict(with_items=True),
                "removed_files": self.removed_files, "removed_bytes": self.removed_bytes,
                "seconds": round(self.seconds, 3), "recorded": not self.dry_run and self.record_error is None,
                "record_error": self.record_error}


def collect_garbage(build: str | Path, dry_run: bool = False, take_over: bool = False) -> GcReport:
    """`hsbuild gc`: under the build lock, find the orphans and (unless dry_run) remove them; record `gc`.
    Durable groups a run would adopt are kept, and listed in `report.orphans.adoptable` (`hsbuild resume`).
    On a full disk the removal still happens (it is what frees space); a `gc` event that cannot be committed
    is reported in `record_error` rather than raised."""
    lay = layout(build).require()
    gc_id = uuid.uuid4().hex
    t0 = time.monotonic()
    with OwnerSession(lay, "gc", gc_id, take_over=take_over, signals=False) as session:
        log = session.open()
        session.status_fn = lambda: {"workers": 0, **log.progress()}
        report = GcReport(gc_id, dry_run, OrphanReport())
        report.orphans = scan_orphans(lay, log)
        if not dry_run:
            report.removed_files, report.removed_bytes = remove_orphans(lay, report.orphans)
            report.seconds = time.monotonic() - t0
            try:
                log.append([Event(EventKind.GC, run_id=gc_id, detail=detail(
                    removed_files=report.removed_files, removed_bytes=report.removed_bytes,
                    items=report.orphans.count, by_kind=report.orphans.by_kind(),
                    kept_adoptable=report.orphans.adoptable_samples, pid=os.getpid()))])
            except DiskFullError as e:
                report.record_error = str(e)
    report.seconds = time.monotonic() - t0
    return report
