"""Orphans: bytes in a build that no committed `written` event references, and `hsbuild gc`, which removes them.

Crashed writers leave them: shard files (and chunk files, in layout 1 segments) in ranges no `written` event
covers, with the manifests of those groups (the group was made durable, its events were never committed), whole
segments no `written` event references, Zarr's `*.<uuid>.partial` temp files and
hsbuild's `.*.<pid>.tmp` temp files. A segment's metadata (zarr.json, seal.json) belongs to it while any
`written` event references the segment. Bytes that a superseded `written` still references (a sample verify
found damaged and resume re-extracted elsewhere) are kept; they are not orphans.

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

from builder.config import load_config
from builder.errors import DiskFullError
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail, open_log
from builder.log.lock import BuildLock
from builder.log.server import QueryServer
from builder.store.segment import FIELDS, MANIFEST_DIR, field_geometry, list_segments
from builder.store.shard import ShardGeometry

PARTIAL_RE = re.compile(r".+\.[0-9a-f]{32}\.partial$")  # zarr LocalStore: path.with_suffix(".<uuid4>.partial")
TMP_RE = re.compile(r"^\..+\.\d+\.tmp$")  # fsutil.atomic_write_bytes: .<name>.<pid>.tmp
ONE_D = {"input_ids", "loss_mask"}


@dataclass
class Orphan:
    path: str  # relative to the build root
    kind: str  # segment | shard | manifest | chunk (layout 1) | partial | tmp
    nbytes: int
    files: int = 1


@dataclass
class OrphanReport:
    orphans: list[Orphan] = field(default_factory=list)

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

    def as_dict(self, with_items: bool = False) -> dict:
        d: dict = {"count": self.count, "files": self.files, "bytes": self.nbytes, "by_kind": self.by_kind()}
        if with_items:
            d["items"] = [o.__dict__ for o in self.orphans]
        return d


def referenced_chunks(log: EventLog) -> dict[str, list[tuple[int, int]]]:
    """Token ranges per segment of every committed `written` event (live or superseded)."""
    _, rows = log.query("SELECT segment, token_start, num_tokens FROM events "
                        "WHERE kind = 'written' AND segment IS NOT NULL ORDER BY segment, token_start")
    out: dict[str, list[tuple[int, int]]] = {}
    for seg, start, n in rows:
        out.setdefault(seg, []).append((int(start), int(n)))
    return out


def _chunk_indices(ranges: list[tuple[int, int]], chunk_tokens: int) -> set[int]:
    idx: set[int] = set()
    for start, n in ranges:
        idx.update(range(start // chunk_tokens, (start + max(n, 1) - 1) // chunk_tokens + 1))
    return idx


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


def _manifest_orphan(parts: tuple[str, ...], seg_dir: Path, starts: set[int]) -> bool:
    """Layout 2: a group manifest none of whose samples is referenced (a group that never committed)."""
    if len(parts) != 2 or parts[0] != MANIFEST_DIR or not parts[1].endswith(".json"):
        return False
    try:
        m = json.loads((seg_dir / parts[0] / parts[1]).read_bytes())
        return not any(int(x["token_start"]) in starts for x in m["samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return True  # unreadable: describes nothing that is committed


def _scan_segment(seg_dir: Path, indices: set[int] | None, root: Path,
                  sharded: tuple[set[int], set[int]] | None = None) -> list[Orphan]:
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
                elif _manifest_orphan(rel, seg_dir, sharded[1]):
                    kind = "manifest"
            elif kind is None and indices is not None and _chunk_orphan(rel, indices):
                kind = "chunk"
            if kind:
                found.append(Orphan(str(Path(full).relative_to(root)), kind, _size(full)))
    return found


def scan_orphans(lay: BuildLayout, log: EventLog) -> OrphanReport:
    """Everything reclaimable in the build. The caller must hold the build lock."""
    refs = referenced_chunks(log)
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
    for seg in list_segments(lay.data):
        seg_dir = lay.data / seg
        if seg not in refs:
            files = [os.path.join(d, f) for d, _, fs in os.walk(seg_dir) for f in fs]
            report.orphans.append(Orphan(str(seg_dir.relative_to(root)), "segment", sum(map(_size, files)),
                                         len(files)))
            continue
        try:
            ct, sc = field_geometry(seg_dir, "aux_hidden_state")
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            ct, sc = default_ct, 0
        if sc:
            geo = ShardGeometry(ct, sc)
            shards = {i for start, n in refs[seg] for i in geo.shards(start, n)}
            report.orphans.extend(_scan_segment(seg_dir, None, root, (shards, {start for start, _ in refs[seg]})))
            continue
        indices = _chunk_indices(refs[seg], ct) if ct else None  # unknown geometry: remove temp files only
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
    On a full disk the removal still happens (it is what frees space); a `gc` event that cannot be committed
    is reported in `record_error` rather than raised."""
    lay = layout(build).require()
    gc_id = uuid.uuid4().hex
    t0 = time.monotonic()
    with BuildLock(lay, "gc", gc_id, take_over=take_over) as lock:
        log = open_log(lay.events)
        report = GcReport(gc_id, dry_run, OrphanReport())
        server = QueryServer(lock.socket_path, log, lambda: {"running": True, "purpose": "gc", "run_id": gc_id,
                                                              "pid": os.getpid(), "workers": 0,
                                                              **log.progress()}).start()
        try:
            report.orphans = scan_orphans(lay, log)
            if not dry_run:
                report.removed_files, report.removed_bytes = remove_orphans(lay, report.orphans)
                report.seconds = time.monotonic() - t0
                try:
                    log.append([Event("gc", run_id=gc_id, detail=detail(
                        removed_files=report.removed_files, removed_bytes=report.removed_bytes,
                        items=report.orphans.count, by_kind=report.orphans.by_kind(), pid=os.getpid()))])
                except DiskFullError as e:
                    report.record_error = str(e)
        finally:
            server.stop()
            log.close()
    report.seconds = time.monotonic() - t0
    return report
