"""`hsbuild export BUILD OUT --format F`: the live samples, in the files a trainer reads.

Write order and what survives a crash (docs/design.md, "Export"):
1. `OUT/hsbuild-export.json` (the journal) is written first, atomically: the build, the format, its options and
   the selection (the sample ids, in export order). A later export into OUT continues that selection and
   refuses other options, so file numbers never shift under an interrupted export.
2. Each sample is read through its checksums (a damaged sample is never exported: it is listed, and
   `hsbuild verify` then `hsbuild resume` repair it) and each of its files is written to a temp name, fsynced
   and renamed: a file under its final name is complete. A restart skips them and removes stray temp files.
3. Before each file the target volume's watermarks are checked (an export doubles storage): at `high` the export
   pauses until usage falls below `low`, and a file that would cross `flood` is never started.
4. After the last sample: the dataset-wide files (token frequencies over loss-masked tokens, the reduced vocab
   mapping, speculators' Arrow index) are written the same way, the directories fsynced, the journal marked
   complete and an `export` event committed to the build's log.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from builder.config import Watermarks, load_config
from builder.errors import DamagedSampleError, FormatError, Interrupted, UsageError, WontFitError
from builder.formats.build_info import BuildInfo
from builder.fsutil import atomic_write_bytes, fsync_path, fsync_paths
from builder.humanize import human_bytes
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail, open_log
from builder.log.lock import BuildLock
from builder.log.server import QueryServer
from builder.progress import NoProgress, Progress
from builder.space.watermarks import Usage, disk_usage
from builder.store.reader import SegmentReader
from builder.trainers import make_format
from builder.trainers.base import Exported, Sample
from builder.verify.sweep import parse_subset, stable_part

JOURNAL = "hsbuild-export.json"
TMP_SUFFIX = ".hsbuild-tmp"


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
    selected: int = 0
    exported: int = 0  # files of samples written by this call
    already: int = 0  # samples a previous call had exported
    damaged: list[dict] = field(default_factory=list)  # {sample_id, reason, message}: listed, never exported
    gone: list[str] = field(default_factory=list)  # selected earlier, no longer live (superseded/retired)
    bytes_written: int = 0
    pauses: int = 0
    seconds: float = 0.0
    layer_ids: list[int] = field(default_factory=list)  # the aux layers in the trainer's own numbering
    final_state: str = ""
    files: list[str] = field(default_factory=list)  # the dataset-wide files written at the end
    complete: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


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
    progress = opts.progress or NoProgress()
    report = ExportReport(export_id, str(out), fmt.name, final_state=fmt.final_state,
                          layer_ids=info.layer_ids()[fmt.layer_convention][:-1])
    t0 = time.monotonic()
    with BuildLock(lay, "export", export_id, take_over=opts.take_over) as lock:
        log = open_log(lay.events)
        server = QueryServer(lock.socket_path, log, lambda: {"running": True, "purpose": "export",
                                                              "run_id": export_id, "pid": os.getpid(),
                                                              "workers": 0, **log.progress()}).start()
        try:
            live = _live_samples(log)
            out_was_new, journal_was_new = not out.exists(), not (out / JOURNAL).exists()
            journal = _journal(lay, out, opts, live, info)
            selection = journal["selection"]
            report.selected = len(selection)
            _remove_temp_files(out)
            reader = SegmentReader(lay.data)
            todo = []
            for index, sid in enumerate(selection):
                e = live.get(sid)
                if e is None:
                    report.gone.append(sid)
                    continue
                todo.append((index, e))
            left = [(i, e) for i, e in todo
                    if not all((out / rel).is_file() for rel in fmt.sample_paths(i, e["sample_id"]))]
            report.already = len(todo) - len(left)
            try:
                _preflight(out, sum(int(e["num_tokens"]) for _, e in left) * _bytes_per_token(info), wm, opts)
            except WontFitError:  # refused before anything was exported: leave OUT as it was
                if journal_was_new:
                    (out / JOURNAL).unlink(missing_ok=True)
                    if out_was_new:
                        out.rmdir()
                raise
            progress.start(len(left), f"export {fmt.name}")
            for index, e in left:
                if opts.stop():
                    raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
                s = _read(reader, info, fmt.final_state, e, index, report)
                if s is None:
                    progress.update(done=1, note="damaged")
                    continue
                files = fmt.sample_files(s)
                size = sum(len(b) for b in files.values())
                report.pauses += _wait_for_space(out, size, wm, opts, progress)
                for rel, data in files.items():
                    _write_file(out / rel, data)
                report.exported += 1
                report.bytes_written += size
                progress.update(done=1, tokens=s.num_tokens, nbytes=size)
            progress.close()
            fsync_paths({out.parent, *_dirs_of(out)})  # every directory a file was renamed into
            if opts.stop():
                raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
            report.files = _finish(out, fmt, info, reader, todo, opts, report)
            report.complete = not report.damaged
            atomic_write_bytes(out / JOURNAL, json.dumps({**journal, "complete": report.complete,
                                                          "report": report.as_dict()}).encode())
            report.seconds = time.monotonic() - t0
            log.append([Event("export", run_id=export_id, detail=detail(
                out=str(out), format=fmt.name, options=opts.recorded(), selected=report.selected,
                exported=report.exported, already=report.already, bytes=report.bytes_written,
                damaged=[d["sample_id"] for d in report.damaged], gone=report.gone, complete=report.complete,
                layer_ids=report.layer_ids, final_state=fmt.final_state, pid=os.getpid()))])
        finally:
            server.stop()
            log.close()
    return report


def _flags(options: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v is not None)


def _live_samples(log: EventLog) -> dict[str, dict]:
    rows = log.query_dicts("SELECT sample_id, row_idx, segment, token_start, num_tokens, checksums FROM samples "
                           "WHERE state IN ('written', 'verified') ORDER BY row_idx")
    return {r["sample_id"]: r for r in rows}


def _journal(lay: BuildLayout, out: Path, opts: ExportOptions, live: dict[str, dict], info: BuildInfo) -> dict:
    """The export's journal: created with the selection on the first call, checked and reused on later ones."""
    path = out / JOURNAL
    build = {"root": str(lay.root), "model": info.model, "aux_layers": list(info.aux_layers),
             "final_state": info.final_state}
    if path.is_file():
        try:
            j = json.loads(path.read_text())
        except ValueError as e:
            raise UsageError(f"{path}: unreadable ({e}); move it away to start this export afresh") from None
        if j.get("build") != build or j.get("options") != opts.recorded():
            was = j.get("build", {}).get("root")
            raise UsageError(f"{out}: holds an export of {was} made with `{_flags(j.get('options') or {})}`; "
                             + ("finish it with exactly those flags, " if was == build["root"] else "")
                             + "or export into a new directory")
        return j
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"{out}: not empty and not an hsbuild export; export into a new or empty directory")
    ids = list(live)
    if opts.subset:
        n, t = parse_subset(opts.subset)
        ids = [s for s in ids if stable_part(s, t) == n - 1]
    if opts.limit is not None:
        ids = ids[: opts.limit]
    if not ids:
        raise FormatError(f"{lay.root}: no written samples to export"
                          + (f" in --subset {opts.subset}" if opts.subset else "")
                          + "; run `hsbuild run` first, or see `hsbuild status`")
    out.mkdir(parents=True, exist_ok=True)
    j = {"hsbuild_export": 1, "build": build, "options": opts.recorded(), "selection": ids,
         "layer_ids": info.layer_ids(), "created_at": time.time(), "complete": False}
    atomic_write_bytes(path, json.dumps(j).encode())
    fsync_path(out.parent)
    return j


def _bytes_per_token(info: BuildInfo) -> int:
    width = 4 if info.dtype == "float32" else 2
    return (info.n_aux + 1) * info.hidden_size * width + 16  # the states, int64 ids and mask


def _preflight(out: Path, projected: int, wm: Watermarks, opts: ExportOptions) -> None:
    """Refuse an export whose projected size would take the target volume past `high` (exit 3), unless
    --allow-overcommit (then it pauses at the watermarks as it goes)."""
    u = disk_usage(out)
    if opts.allow_overcommit or not projected or (u.used + projected) / u.total < wm.high:
        return
    room = max(0, int(u.total * wm.high) - u.used)
    raise WontFitError(f"{out}: the export needs about {human_bytes(projected)} but its volume has "
                       f"{human_bytes(room)} below the high watermark ({wm.high:.0%}); free space, export "
                       "a part (--subset/--limit), or pass --allow-overcommit to pause at the watermarks instead")


def _read(reader: SegmentReader, info: BuildInfo, final_state: str, e: dict, index: int,
          report: ExportReport) -> Sample | None:
    try:
        t = reader.read(e["segment"], e["token_start"], e["num_tokens"], e["checksums"])
    except DamagedSampleError as err:
        report.damaged.append({"sample_id": e["sample_id"], "reason": err.reason, "message": str(err)})
        return None
    return Sample(e["sample_id"], int(e["row_idx"]), index, t["input_ids"].long(), t["loss_mask"].long(),
                  t["aux_hidden_state"], info.final(t["hidden_state"], final_state))


def _write_file(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Temp name, fsync, rename: under its final name a file is whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if callable(data):
        data(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, path)


def _remove_temp_files(out: Path) -> None:
    for p in out.rglob("*" + TMP_SUFFIX):
        p.unlink(missing_ok=True)


def _dirs_of(out: Path) -> Iterator[Path]:
    yield out
    for p in out.rglob("*"):
        if p.is_dir():
            yield p


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


def _finish(out: Path, fmt, info: BuildInfo, reader: SegmentReader, todo: list[tuple[int, dict]],
            opts: ExportOptions, report: ExportReport) -> list[str]:
    """The dataset-wide files: token frequencies over loss-masked tokens (what every trainer builds its reduced
    draft vocabulary from), the vocab mapping, and any index of the rows (read again, tokens and mask only)."""
    damaged = {d["sample_id"] for d in report.damaged}
    rows_in = [(i, e) for i, e in todo if e["sample_id"] not in damaged]

    def rows() -> Iterator[Exported]:
        for index, e in rows_in:
            t = reader.read_raw(e["segment"], e["token_start"], e["num_tokens"], e["checksums"],
                                fields=("input_ids", "loss_mask"))
            yield Exported(e["sample_id"], index, t["input_ids"].astype("int64").tolist(),
                           t["loss_mask"].astype("int64").tolist())

    freq: Counter[int] = Counter()
    for r in rows():
        freq.update(t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m)
    files = fmt.finish_files(out, rows(), freq, info.vocab_size, opts.draft_vocab_size)
    for rel, data in files.items():
        _write_file(out / rel, data)
    fsync_paths({(out / rel).parent for rel in files})
    return sorted(files)
