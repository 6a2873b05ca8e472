"""`hsbuild export BUILD OUT --format F`: the build's samples in the files a trainer reads. An export is a view of
the build: every run brings OUT to the build's present state (docs/design.md, "Export: write order and
invariants").

- The selection is taken afresh on every run: the build's samples but the retired ones (skipped, removed from
  the source), in source-row order, then `--subset n/t` and `--limit N`. Each live one is in the export; every
  other one (not yet written, failed, damaged) is named in the report (exit 1), and the first run after its
  repair exports it.
- Row i of the export is the i-th exported sample: SpecForge's `data_{i}`, speculators' `hs_{i}` and its Arrow
  row i (speculators' loader maps row i to `hs_{i}` and nothing else). A sample that leaves or joins before a
  file renumbers it: the file is moved, never rewritten (a file's bytes never depend on its number).
- The journal `OUT/hsbuild-export.json` vouches, per sample, for one file: its path, the sample's fingerprint
  (its source fingerprint and where and what its stored states are: segment, offset, length, CRC-32Cs), and the
  file's blake2b and size. A re-run keeps a file whose sample's fingerprint is unchanged (not read again),
  rewrites the files of changed samples, removes those of samples no longer selected or live, and removes any
  sample file the journal does not vouch for.

Write order, each step safe against `kill -9` (a re-run gives the same files as one uninterrupted export):
1. survey: each vouched file must exist with its size; a file whose move was under way is found by its blake2b
   among the paths it could be at. Temp files are removed, and the journal is rewritten (not finished; vouching
   for what the survey found, no more) before anything else is written.
2. the kept samples' tokens and masks are read (checked: a damaged one leaves the export) for the dataset-wide
   files; then each new or changed sample is read through its checksums and its file written (temp, fsync,
   rename) to its final path if the journal vouches for nothing there, else under `.hsbuild-staging/`; every few
   seconds the directories are fsynced and the journal rewritten (atomically) to vouch for the new files.
   Before each file the target volume's watermarks are checked.
3. layout: the journal first drops the samples leaving and marks each file about to move as in doubt; then the
   leaving and unvouched files are removed, the moving ones renamed through `.hsbuild-staging/` to their rows'
   paths, the directories fsynced and the journal rewritten.
4. the dataset-wide files (token frequencies, the vocab mapping, speculators' Arrow index), when the rows
   changed, written the same way; the journal marked finished (and complete when no selected sample is left
   out); an `export` event committed to the build's log.
A full target volume (ENOSPC/EDQUOT, where the watermarks could not see it coming) stops the export with one
`DiskFullError` (exit 3) after the journal is saved if it can be; the same command continues once there is room.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from builder.config import Watermarks, load_config
from builder.errors import (
    DamagedSampleError,
    DiskFullError,
    FormatError,
    Interrupted,
    UsageError,
    WontFitError,
)
from builder.exchange.build_info import BuildInfo
from builder.exchange.lossy import export_lossy
from builder.formats import make_format
from builder.formats.base import Exported, Sample, TrainerFormat
from builder.fsutil import fsync_path, fsync_paths
from builder.humanize import human_bytes
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.session import OwnerSession
from builder.progress import NoProgress, Progress
from builder.space.watermarks import Usage, disk_usage
from builder.store.dtypes import itemsize
from builder.store.reader import SegmentReader
from builder.verify.sweep import parse_subset, stable_part

JOURNAL = "hsbuild-export.json"
JOURNAL_VERSION = 2
TMP_SUFFIX = ".hsbuild-tmp"
STAGING = ".hsbuild-staging"  # files written or moved before their row's path is free
STAGED_SUFFIX = ".hsbuild-staged"  # no trainer reads such a name (ModelOpt takes every *.pt under OUT)
LIVE = ("written", "verified")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
SAVE_EVERY_S = 2.0  # the journal vouches for new files at least this often (and at most 10% of the time)
TOKEN_CACHE = 1 << 24  # tokens (ids and mask) kept from the first read for the dataset-wide files; beyond: read again


@dataclass
class ExportOptions:
    format: str = "specforge"
    subset: str | None = None  # "n/t": the n-th of t fixed parts, as verify's --subset
    limit: int | None = None
    max_len: int | None = None  # specforge's dataset: keep this many tokens (data.max_length)
    compress: int | None = None  # specforge: gzip level (its --compress)
    draft_vocab_size: int | None = None  # also write the d2t/t2d mapping for a draft vocabulary of this size
    allow_overcommit: bool = False
    watermarks: Watermarks | None = None  # default: the build's [watermarks]
    take_over: bool = False
    progress: Progress | None = None
    stop: Callable[[], bool] = lambda: False  # polled between files (Ctrl-C): raises Interrupted, resumable

    def recorded(self) -> dict:
        return {"format": self.format, "subset": self.subset, "limit": self.limit, "max_len": self.max_len,
                "compress": self.compress, "draft_vocab_size": self.draft_vocab_size}


@dataclass
class ExportReport:
    export_id: str
    out: str
    format: str
    selected: int = 0  # the samples this export covers: the build's, retired ones aside, in --subset/--limit
    rows: int = 0  # samples in the export now (row i = file i)
    exported: int = 0  # sample files written by this call (added + rewritten)
    already: int = 0  # samples whose file was kept (not rewritten; maybe renumbered)
    added: list[str] = field(default_factory=list)  # samples new to the export
    rewritten: list[str] = field(default_factory=list)  # samples whose stored states or tokens changed
    removed: list[str] = field(default_factory=list)  # samples whose file was removed (no longer selected/live)
    renumbered: int = 0  # kept files moved to another row's path
    not_exported: list[dict] = field(default_factory=list)  # {sample_id, state, reason, message}: selected, left out
    damaged: list[dict] = field(default_factory=list)  # those of not_exported whose stored bytes failed their check
    bytes_written: int = 0
    pauses: int = 0
    seconds: float = 0.0
    layer_ids: list[int] = field(default_factory=list)  # the aux layers in the trainer's own numbering
    final_state: str = ""
    files: list[str] = field(default_factory=list)  # the dataset-wide files (written by this call, or kept)
    complete: bool = False  # every selected sample is in the export
    layer_flag: str | None = None  # what the trainer must be told to take these aux layers (None: its default)
    lossy: dict | None = None  # an fp8 build: its scheme and measured error (hsbuild-lossy.json), else None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Entry:
    """What the journal vouches for: the sample's file at `path` holds the sample as of fingerprint `fp`, with
    these bytes (`sum`, blake2b-128) and `size`. `at`: a move was under way, the file is at one of these paths."""

    path: str
    fp: str
    sum: str
    size: int
    at: list[str] | None = None

    def dump(self) -> list:
        return [self.path, self.fp, self.sum, self.size] + ([self.at] if self.at else [])

    @classmethod
    def load(cls, v: object) -> Entry | None:
        if not (isinstance(v, list) and len(v) in (4, 5) and all(isinstance(x, str) for x in v[:3])
                and isinstance(v[3], int) and _safe_rel(v[0])):
            return None
        at = v[4] if len(v) == 5 else None
        if at is not None and not (isinstance(at, list) and at and all(_safe_rel(a) for a in at)):
            return None
        return cls(v[0], v[1], v[2], v[3], at)


def _safe_rel(p: object) -> bool:
    return isinstance(p, str) and bool(p) and not p.startswith("/") and ".." not in p.split("/")


def export_build(build: str | Path, out: str | Path, opts: ExportOptions) -> ExportReport:
    lay = layout(build).require()
    fmt = make_format(opts.format, max_len=opts.max_len, compress=opts.compress)
    info = BuildInfo.load(lay)
    info.require(fmt.final_state)
    out = Path(out).absolute()
    if out == lay.root or lay.root in out.parents:
        raise UsageError(f"{out}: inside the build; export to a directory outside {lay.root}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; choose a directory for the export")
    if opts.limit is not None and opts.limit < 1:
        raise UsageError(f"--limit {opts.limit}: must be at least 1")
    if opts.subset is not None:
        parse_subset(opts.subset)
    if opts.draft_vocab_size is not None and not 0 < opts.draft_vocab_size <= info.vocab_size:
        raise FormatError(f"--draft-vocab-size {opts.draft_vocab_size}: must be between 1 and the model's "
                          f"vocabulary size {info.vocab_size}")
    wm = (opts.watermarks or load_config(lay).watermarks).validate()
    export_id = uuid.uuid4().hex
    report = ExportReport(export_id, str(out), fmt.name, final_state=fmt.final_state,
                          layer_ids=info.layer_ids()[fmt.layer_convention][:-1])
    t0 = time.monotonic()
    # the owner session: lock, log, queries, stall watch and Ctrl-C (builder/log/session.py): the first SIGINT or
    # SIGTERM stops the export at the next file boundary (Interrupted), a second exits at once (still resumable)
    with OwnerSession(lay, "export", export_id, take_over=opts.take_over) as session:
        log = session.open()
        asked = opts.stop
        opts = replace(opts, stop=lambda: asked() or session.stop_requested > 0)
        session.status_fn = lambda: {"workers": 0, **log.progress()}
        sel = _selection(log, opts)
        head = _head(lay, opts, info)
        loaded = _load_journal(out, head)
        if loaded is None and not any(e["state"] in LIVE for e in sel):
            raise FormatError(f"{lay.root}: no written samples to export"
                              + (f" in --subset {opts.subset}" if opts.subset else "")
                              + "; run `hsbuild run` first, or see `hsbuild status`")
        report.layer_flag = info.layer_flag(fmt.name)
        job = _Export(str(lay.root), out, fmt, info, SegmentReader(lay.data), opts, wm, report)
        job.lossy = lambda ids: export_lossy(out, info, lambda sql: log.query(sql)[1], ids, fmt.final_state)
        job.run(sel, head, loaded)
        report.seconds = time.monotonic() - t0
        left_out = [d["sample_id"] for d in report.not_exported]
        log.append([Event("export", run_id=export_id, detail=detail(
            out=str(out), format=fmt.name, options=opts.recorded(), selected=report.selected, rows=report.rows,
            exported=report.exported, already=report.already, added=len(report.added),
            rewritten=len(report.rewritten), removed=len(report.removed), renumbered=report.renumbered,
            not_exported=len(left_out), not_exported_ids=left_out[:100], bytes=report.bytes_written,
            damaged=[d["sample_id"] for d in report.damaged], complete=report.complete,
            layer_ids=report.layer_ids, final_state=fmt.final_state, pid=os.getpid()))])
    return report


def _flags(options: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v is not None)


def _selection(log: EventLog, opts: ExportOptions) -> list[dict]:
    """The samples this export covers, in export order: every sample but the retired ones, by source row, then
    --subset and --limit."""
    rows = log.query_dicts("SELECT sample_id, row_idx, fingerprint, state, error, segment, token_start, num_tokens, "
                           "checksums FROM samples WHERE state <> 'retired' ORDER BY row_idx, sample_id")
    if opts.subset:
        n, t = parse_subset(opts.subset)
        rows = [r for r in rows if stable_part(r["sample_id"], t) == n - 1]
    if opts.limit is not None:
        rows = rows[: opts.limit]
    return rows


def _fingerprint(e: dict) -> str:
    """Changes when the sample's source tokens change or its states are written again (another segment, offset,
    length or checksums): what decides whether an exported file still holds the sample."""
    key = json.dumps([e["fingerprint"], e["segment"], int(e["token_start"]), int(e["num_tokens"]), e["checksums"]])
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _not_written(e: dict) -> dict:
    state, err = e["state"], e.get("error")
    if state == "failed":
        msg = f"failed ({err})" + ("; its stored bytes are damaged" if err in ("checksum_mismatch", "missing_data",
                                                                              "unreadable") else "")
        return {"sample_id": e["sample_id"], "state": state, "reason": err or "failed", "message": msg}
    msg = "a run stopped while extracting it" if state == "started" else "not extracted yet"
    return {"sample_id": e["sample_id"], "state": state, "reason": "not_written", "message": msg}


def _head(lay: BuildLayout, opts: ExportOptions, info: BuildInfo) -> dict:
    return {"hsbuild_export": JOURNAL_VERSION,
            "build": {"root": str(lay.root), "model": info.model, "aux_layers": list(info.aux_layers),
                      "final_state": info.final_state},
            "options": opts.recorded(), "layer_ids": info.layer_ids()}


def _is_temp(name: str) -> bool:
    return name.endswith(TMP_SUFFIX) or (name.startswith(".hsbuild-") and name.endswith(".tmp"))


def _load_journal(out: Path, head: dict) -> dict | None:
    """OUT's journal (checked: same build, same options), or None when OUT is new or empty (temp files aside)."""
    path = out / JOURNAL
    if path.is_file():
        try:
            j = json.loads(path.read_text())
            if not isinstance(j, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise UsageError(f"{path}: unreadable ({e}); move it away to start this export afresh") from None
        if j.get("build") != head["build"] or j.get("options") != head["options"]:
            was = (j.get("build") or {}).get("root")
            raise UsageError(f"{out}: holds an export of {was} made with `{_flags(j.get('options') or {})}`; "
                             + ("run it again with exactly those flags, " if was == head["build"]["root"] else "")
                             + "or export into a new directory")
        return j
    if out.is_dir() and any(not _is_temp(p.name) for p in out.iterdir()):
        raise UsageError(f"{out}: not empty and not an hsbuild export; export into a new or empty directory")
    return None


def _atomic_json(path: Path, obj: dict) -> None:
    """Temp file, fsync, rename (`_write_file`), then fsync the directory; a failed write leaves no temp file."""
    _write_file(path, json.dumps(obj, separators=(",", ":")).encode())
    fsync_path(path.parent)


def _write_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Temp name, fsync, rename: under its final name a file is whole. A failed write leaves no temp file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        if callable(data):
            data(tmp)
            fsync_path(tmp)
        else:
            _write_bytes(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_temp_files(out: Path) -> None:
    for p in out.rglob("*"):
        if _is_temp(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def _count(freq: Counter[int], ids: np.ndarray, mask: np.ndarray) -> None:
    """Add the loss-masked tokens of one sample to `freq`."""
    tokens, counts = np.unique(np.asarray(ids)[np.asarray(mask) != 0], return_counts=True)
    freq.update(dict(zip(tokens.tolist(), counts.tolist(), strict=True)))


def _staged(sid: str, fp: str) -> str:
    return f"{STAGING}/{hashlib.blake2b(sid.encode(), digest_size=12).hexdigest()}.{fp[:16]}{STAGED_SUFFIX}"


class _Export:
    """One run of an export: survey what OUT holds, write what is new or changed, lay the rows out, finish."""

    def __init__(self, build: str, out: Path, fmt: TrainerFormat, info: BuildInfo, reader: SegmentReader,
                 opts: ExportOptions, wm: Watermarks, report: ExportReport):
        self.build = build
        self.out, self.fmt, self.info, self.reader, self.opts, self.wm, self.report = \
            out, fmt, info, reader, opts, wm, report
        self.progress = opts.progress or NoProgress()
        self.head: dict = {}
        self.entries: dict[str, Entry] = {}  # sample id -> the file vouched for (in memory; see `save`)
        self.on_disk: set[str] = set()  # every path the journal on disk vouches for (or names as a candidate)
        self.finish_rec: dict = {"key": None, "files": {}}
        self.dirty_dirs: set[Path] = set()  # directories renamed into since the last save
        self.next_save = 0.0
        self.save_cost = 0.0
        self.lossy: Callable[[list[str]], dict | None] = lambda ids: None  # writes hsbuild-lossy.json (fp8 builds)
        self.tokens: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # sample id -> (ids, mask), up to TOKEN_CACHE
        self.cached = 0

    # -- the journal ---------------------------------------------------------------------------------------------

    def save(self, finished: bool = False, selection: list[str] | None = None) -> None:
        """Make what the files say durable (fsync the directories renamed into), then rewrite the journal."""
        if self.dirty_dirs:
            fsync_paths(self.dirty_dirs)
            self.dirty_dirs.clear()
        t = time.monotonic()
        _atomic_json(self.out / JOURNAL, {
            **self.head, "updated_at": time.time(), "finished": finished,
            "complete": finished and self.report.complete, "selection": selection,
            "files": {sid: en.dump() for sid, en in self.entries.items()}, "finish": self.finish_rec,
            "report": self.report.as_dict() if finished else None})
        self.on_disk = {p for en in self.entries.values() for p in (en.at or [en.path])}
        self.save_cost = time.monotonic() - t
        self.next_save = time.monotonic() + max(SAVE_EVERY_S, 10 * self.save_cost)

    def _holds(self, rel: str, size: int) -> bool:
        try:
            st = os.stat(self.out / rel)
        except OSError:
            return False
        return st.st_size == size and os.path.isfile(self.out / rel)

    def survey(self, j: dict) -> None:
        """The journal's entries whose files are where it says (exist, with their size; a file in doubt found by
        its blake2b among the paths it may be at)."""
        files = j.get("files") if j.get("hsbuild_export") == JOURNAL_VERSION else None
        raw = files if isinstance(files, dict) else {}
        loaded = {sid: Entry.load(v) for sid, v in raw.items()}
        claimed: set[str] = set()
        for sid, en in loaded.items():
            if en is not None and en.at is None:
                if en.path not in claimed and self._holds(en.path, en.size):
                    self.entries[sid] = en
                    claimed.add(en.path)
        for sid, en in loaded.items():
            if en is None or en.at is None:
                continue
            for cand in en.at:
                if cand not in claimed and self._holds(cand, en.size) and _file_digest(self.out / cand) == en.sum:
                    self.entries[sid] = Entry(cand, en.fp, en.sum, en.size)
                    claimed.add(cand)
                    break
        self.on_disk = {p for en in loaded.values() if en is not None for p in (en.at or [en.path])}
        fin = j.get("finish") if isinstance(j.get("finish"), dict) else {}
        files_ok = isinstance(fin.get("files"), dict) and all(
            isinstance(v, list) and len(v) == 2 and _safe_rel(k) for k, v in fin["files"].items())
        self.finish_rec = {"key": fin.get("key"), "files": fin["files"] if files_ok else {}}

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self, sel: list[dict], head: dict, j: dict | None) -> None:
        try:
            self._run(sel, head, j)
        except OSError as e:
            if e.errno not in NO_SPACE or isinstance(e, DamagedSampleError):
                raise
            if self.head:
                try:  # keep what is written (best effort: the journal needs room too)
                    self.save()
                except OSError:
                    pass
            written = self.report.exported
            raise DiskFullError(f"{self.out}: its volume is full ({os.strerror(e.errno)}) after {written} sample "
                                f"file(s) written; free space there and run the same command again: it continues "
                                "from what its journal kept") from None

    def _run(self, sel: list[dict], head: dict, j: dict | None) -> None:
        out, fmt, rep = self.out, self.fmt, self.report
        created = j.get("created_at") if j else None
        if j is not None:
            self.survey(j)
        prior = set(self.entries) | set((j or {}).get("files") or {})
        rep.selected = len(sel)
        live = [e for e in sel if e["state"] in LIVE]
        rep.not_exported = [_not_written(e) for e in sel if e["state"] not in LIVE]
        fps = {e["sample_id"]: _fingerprint(e) for e in live}
        kept = {e["sample_id"] for e in live if e["sample_id"] in self.entries
                and self.entries[e["sample_id"]].fp == fps[e["sample_id"]]}
        todo = [e for e in live if e["sample_id"] not in kept]

        _preflight(out, sum(int(e["num_tokens"]) for e in todo) * _bytes_per_token(self.info), self.wm, self.opts)
        self.head = {**head, "created_at": created or time.time()}
        if j is None:
            new_dir = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            if new_dir:
                fsync_path(out.parent)
        _remove_temp_files(out)
        self.save()  # never vouch on disk for more than is there; not finished while this run changes OUT

        # 2. the kept samples' tokens (the dataset-wide files need them; a damaged one leaves the export)
        freq: Counter[int] = Counter()
        damaged: set[str] = set()
        for e in live:
            sid = e["sample_id"]
            if sid not in kept:
                continue
            if self.opts.stop():
                raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
            try:
                t = self.reader.read_raw(e["segment"], e["token_start"], e["num_tokens"], e["checksums"],
                                         fields=("input_ids", "loss_mask"))
            except DamagedSampleError as err:
                self._damaged(sid, err, damaged)
                continue
            self._keep(sid, t["input_ids"], t["loss_mask"], freq)

        # 2. the new and changed samples, each to its row's path when nothing vouched for is there
        self.progress.start(len(todo), f"export {fmt.name}")
        row = 0
        occupied = self.on_disk | {en.path for en in self.entries.values()}
        for e in live:
            sid = e["sample_id"]
            if sid in kept:
                row += sid not in damaged
                continue
            if self.opts.stop():
                self.save()
                raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
            s = self._read(e, row, damaged)
            if s is None:
                self.progress.update(done=1, note="damaged")
                continue
            files = fmt.sample_files(s)
            if len(files) != 1:
                raise FormatError(f"{fmt.name}: {len(files)} files for one sample; an export writes one")
            data = next(iter(files.values()))
            target = fmt.sample_paths(row, sid)[0]
            rel = target if target not in occupied else _staged(sid, fps[sid])
            rep.pauses += _wait_for_space(out, len(data), self.wm, self.opts, self.progress)
            _write_file(out / rel, data)
            self.dirty_dirs.add((out / rel).parent)
            occupied.add(rel)
            self.entries[sid] = Entry(rel, fps[sid], _digest(data), len(data))
            (rep.rewritten if sid in prior else rep.added).append(sid)
            rep.exported += 1
            rep.bytes_written += len(data)
            self._keep(sid, s.input_ids.numpy(), s.loss_mask.numpy(), freq)
            row += 1
            self.progress.update(done=1, tokens=s.num_tokens, nbytes=len(data))
            if time.monotonic() >= self.next_save:
                self.save()
                occupied = self.on_disk | {en.path for en in self.entries.values()}
        self.progress.close()

        # 3. the layout: row i at its path; nothing else that a trainer would read as a sample
        rows = [e for e in live if e["sample_id"] in self.entries and e["sample_id"] not in damaged
                and self.entries[e["sample_id"]].fp == fps[e["sample_id"]]]
        self._layout(rows, kept)
        if self.opts.stop():
            raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")

        # 4. the dataset-wide files, the journal finished
        self._finish(rows, freq)
        rep.removed.sort()
        self._close(live)

    def _keep(self, sid: str, ids: np.ndarray, mask: np.ndarray, freq: Counter[int]) -> None:
        """Count the sample's loss-masked tokens; keep its tokens for the dataset-wide files while there is room."""
        _count(freq, ids, mask)
        if self.cached + len(ids) <= TOKEN_CACHE:
            self.tokens[sid] = (np.asarray(ids), np.asarray(mask))  # as stored (int32, uint8): ~5 bytes a token
            self.cached += len(ids)

    def _damaged(self, sid: str, err: DamagedSampleError, damaged: set[str]) -> None:
        d = {"sample_id": sid, "state": "damaged", "reason": err.reason,
             "message": str(err.with_context(sid, self.build))}
        self.report.damaged.append(d)
        self.report.not_exported.append(d)
        damaged.add(sid)

    def _read(self, e: dict, index: int, damaged: set[str]) -> Sample | None:
        try:
            t = self.reader.read(e["segment"], e["token_start"], e["num_tokens"], e["checksums"])
        except DamagedSampleError as err:
            self._damaged(e["sample_id"], err, damaged)
            return None
        return Sample(e["sample_id"], int(e["row_idx"]), index, t["input_ids"].long(), t["loss_mask"].long(),
                      t["aux_hidden_state"], self.info.final(t["hidden_state"], self.fmt.final_state))

    def _sample_files_on_disk(self) -> set[str]:
        """Every file under OUT that the trainer would read as a sample, and every staged file."""
        found = {p.relative_to(self.out).as_posix() for p in self.fmt.scan(self.out)} if self.out.is_dir() else set()
        staging = self.out / STAGING
        if staging.is_dir():
            found |= {p.relative_to(self.out).as_posix() for p in staging.iterdir() if p.is_file()}
        return found

    def _layout(self, rows: list[dict], kept: set[str]) -> None:
        out, rep = self.out, self.report
        target = {e["sample_id"]: self.fmt.sample_paths(i, e["sample_id"])[0] for i, e in enumerate(rows)}
        leaving = sorted(sid for sid in self.entries if sid not in target)
        movers = [sid for sid in target if self.entries[sid].path != target[sid]]
        for sid in leaving:
            rep.removed.append(sid)
        staying = {self.entries[sid].path for sid in target}
        strays = sorted(self._sample_files_on_disk() - staying)
        gone = [self.entries[sid].path for sid in leaving]
        if not (leaving or movers or strays):
            return
        for sid in leaving:
            del self.entries[sid]
        for sid in movers:
            en = self.entries[sid]
            staged = _staged(sid, en.fp)
            en.at = list(dict.fromkeys([en.path, staged, target[sid]]))
        self.save()  # the leaving ones no longer vouched for; the moving ones in doubt
        touched: set[Path] = set()
        for rel in dict.fromkeys(gone + strays):
            if rel not in staying:
                (out / rel).unlink(missing_ok=True)
                touched.add((out / rel).parent)
        for sid in movers:  # through the staging folder: a row's path is free once everything has left it
            en = self.entries[sid]
            staged = _staged(sid, en.fp)
            if en.path != staged:
                (out / STAGING).mkdir(exist_ok=True)
                os.replace(out / en.path, out / staged)
                touched.add((out / en.path).parent)
                en.path = staged
        for sid in movers:
            en = self.entries[sid]
            dst = out / target[sid]
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / en.path, dst)
            self.dirty_dirs.add(dst.parent)
            en.path, en.at = target[sid], None
            if sid in kept:
                rep.renumbered += 1
        self.dirty_dirs |= {d for d in touched | {out / STAGING} if d.is_dir()}
        self.save()
        for d in sorted(touched | {out / STAGING}, key=lambda p: -len(p.parts)):  # empty folders of ours go
            while d != out and out in d.parents:
                try:
                    d.rmdir()
                except OSError:
                    break
                d = d.parent

    def _finish_key(self, rows: list[dict], fps: dict[str, str]) -> str:
        return _digest(json.dumps([[e["sample_id"], fps[e["sample_id"]]] for e in rows]
                                  + [self.opts.draft_vocab_size]).encode())

    def _finish(self, rows: list[dict], freq: Counter[int]) -> None:
        """The dataset-wide files: token frequencies over loss-masked tokens (what every trainer builds its
        reduced draft vocabulary from), the vocab mapping, and any index of the rows (read again, tokens and mask
        only), each written again only when the rows changed."""
        out, fmt, info = self.out, self.fmt, self.info
        fps = {e["sample_id"]: self.entries[e["sample_id"]].fp for e in rows}
        key = self._finish_key(rows, fps)
        rec = self.finish_rec
        if rec.get("key") == key and all(self._holds(rel, v[1]) for rel, v in rec["files"].items()):
            self.report.files = sorted(rec["files"])
            return

        def rows_iter() -> Iterator[Exported]:
            for index, e in enumerate(rows):
                kept = self.tokens.get(e["sample_id"])
                if kept is None:
                    t = self.reader.read_raw(e["segment"], e["token_start"], e["num_tokens"], e["checksums"],
                                             fields=("input_ids", "loss_mask"))
                    kept = (t["input_ids"], t["loss_mask"])
                yield Exported(e["sample_id"], index, kept[0].astype("int64").tolist(), kept[1].astype("int64").tolist())

        self.finish_rec = {"key": None, "files": rec["files"]}  # the files on disk are being replaced
        self.save()
        files = fmt.finish_files(out, rows_iter(), freq, info.vocab_size, self.opts.draft_vocab_size)
        written: dict[str, list] = {}
        for rel, data in files.items():
            _write_file(out / rel, data)
            if callable(data):
                written[rel] = [_file_digest(out / rel), (out / rel).stat().st_size]
            else:
                written[rel] = [_digest(data), len(data)]
            self.dirty_dirs.add((out / rel).parent)
        for rel in set(rec["files"]) - set(written):
            (out / rel).unlink(missing_ok=True)
        self.finish_rec = {"key": key, "files": written}
        self.report.files = sorted(written)

    def _close(self, live: list[dict]) -> None:
        rep = self.report
        order = {e["sample_id"]: i for i, e in enumerate(live)}
        selection = sorted(self.entries, key=lambda sid: order.get(sid, len(order)))
        rep.rows = len(selection)
        rep.already = rep.rows - rep.exported
        rep.complete = not rep.not_exported
        rep.lossy = self.lossy(selection)
        self.save(finished=True, selection=selection)


def _bytes_per_token(info: BuildInfo) -> int:
    return (info.n_aux + 1) * info.hidden_size * itemsize(info.dtype) + 16  # the states, int64 ids and mask


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _preflight(out: Path, projected: int, wm: Watermarks, opts: ExportOptions) -> None:
    """Refuse an export whose projected size would take the target volume past `high` (exit 3), unless
    --allow-overcommit (then it pauses at the watermarks as it goes)."""
    if opts.allow_overcommit or not projected:
        return
    u = disk_usage(_existing(out))
    if (u.used + projected) / u.total < wm.high:
        return
    room = max(0, int(u.total * wm.high) - u.used)
    raise WontFitError(f"{out}: the export needs about {human_bytes(projected)} but its volume has "
                       f"{human_bytes(room)} below the high watermark ({wm.high:.0%}); free space, export "
                       "a part (--subset/--limit), or pass --allow-overcommit to pause at the watermarks instead")


def _wait_for_space(out: Path, size: int, wm: Watermarks, opts: ExportOptions, progress: Progress) -> int:
    """Pause (polling) while the target volume is at `high`, or while this file would cross `flood`; until
    usage is under `low` again. Returns 1 if it paused. Never pauses under --allow-overcommit's preflight alone."""
    def fits(u: Usage, under: float) -> bool:  # usage below `under`, and this file neither crosses flood nor min_free
        return u.usage < under and (u.used + size) / u.total < wm.flood and (not wm.min_free or u.free - size >= wm.min_free)

    u = disk_usage(out)
    if fits(u, wm.high):
        return 0
    if size > u.total * wm.flood:
        raise WontFitError(f"{out}: one file of {human_bytes(size)} cannot fit below the flood watermark of its "
                           "volume even if it were empty; export to a bigger volume")
    while True:
        progress.update(note=f"paused: {out} volume at {u.usage:.0%} (resumes below {wm.low:.0%})")
        if opts.stop():
            raise Interrupted(f"export into {out} interrupted while paused for space; run it again to finish")
        time.sleep(1.0)
        u = disk_usage(out)
        if fits(u, wm.low):
            return 1
