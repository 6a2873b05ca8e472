"""`hsbuild export BUILD OUT --format F`: the build's samples in the files a trainer reads. An export is a view of
the build: every run brings OUT to the build's present state (docs/design.md, "Export: write order and
invariants").

- The selection is taken afresh on every run: the build's samples but the retired ones (skipped, removed from
  the source), in source-row order, then `--subset n/t` and `--limit N`. Each live one is in the export; every
  other one (not yet written, failed, damaged, or refused by its format: `TrainerFormat.prepare`, e.g. a chat
  sample whose source row changed) is named in the report (exit 1), and the first run after its repair exports it.
- Row i of the export is the i-th exported sample: SpecForge's `data_{i}`, speculators' `hs_{i}` and its Arrow
  row i (speculators' loader maps row i to `hs_{i}` and nothing else). A sample that leaves or joins before a
  file renumbers it: the file is moved, never rewritten (a file's bytes never depend on its number).
- The journal `OUT/hsbuild-export.json` vouches, per sample, for one file: its path, the sample's fingerprint
  (its source fingerprint and where and what its stored states are: segment, offset, length, CRC-32Cs), and the
  file's checksum (CRC-32C; a blake2b in a journal from before it) and size. A re-run keeps a file whose
  sample's fingerprint is unchanged (its states not read again) and whose bytes still match that checksum (the
  file is read once), rewrites the files of changed samples (and, named `repaired`, of unchanged ones whose file
  is not whole), removes those of samples no longer selected or live, and removes any sample file the journal
  does not vouch for.

Write order, each step safe against `kill -9` (a re-run gives the same files as one uninterrupted export):
1. survey: each vouched file must exist with its size and checksum; a file whose move was under way is found by
   its checksum among the paths it could be at. Temp files are removed, and the journal is rewritten (not
   finished; vouching for what the survey found, no more) before anything else is written.
2. the kept samples' tokens and masks are read (checked: a damaged one leaves the export) for the dataset-wide
   files; then each new or changed sample is read through its checksums (a batch at a time) and its file written
   (temp, fsync, rename; on 8 threads: export_writers.py; a big one torch.saved straight into its temp file) to
   its final path if the journal vouches for nothing there, else under `.hsbuild-staging/`; every few seconds
   the directories are fsynced and the journal rewritten (atomically) to vouch for the files whose writes have
   returned. Before each file the target volume's watermarks are checked.
3. layout: the journal first drops the samples leaving and marks each file about to move as in doubt; then the
   leaving and unvouched files are removed, the moving ones renamed through `.hsbuild-staging/` to their rows'
   paths, the directories fsynced and the journal rewritten; then every empty folder under OUT is removed
   (those this run emptied, and those a killed run left).
4. the dataset-wide files (token frequencies, the vocab mapping, speculators' Arrow index), when the rows
   changed, written the same way; the journal marked finished (and complete when no selected sample is left
   out); an `export` event committed to the build's log (not where the build cannot be written: a read-only
   build is only read, `recorded` False in the report).
A full target volume (ENOSPC/EDQUOT, where the watermarks could not see it coming) stops the export with one
`DiskFullError` (exit 3) after the journal is saved if it can be; the same command continues once there is room.

Here: the options, the report, the selection and the owner session. The journal and the atomic writes are in
`export_files`, the target volume's watermarks in `export_space`, one run of the write order in
`export_reconcile`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from builder.config import Watermarks, load_config
from builder.errors import BuildReadOnlyError, FormatError, UsageError
from builder.exchange.export_files import JOURNAL, JOURNAL_VERSION, STAGING, TMP_SUFFIX, load_journal
from builder.exchange.export_readonly import ReadOnlyBuild
from builder.exchange.export_reconcile import LIVE, Reconcile
from builder.exchange.export_space import check_target
from builder.exchange.export_view import ExportBuildView
from builder.formats import make_format
from builder.formats.build_info import BuildInfo
from builder.formats.lossy import export_lossy
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.session import OwnerSession
from builder.progress import Echo, Progress, quiet
from builder.store.reader import SegmentReader
from builder.subset import parse_subset, stable_part

__all__ = ["JOURNAL", "STAGING", "TMP_SUFFIX", "ExportOptions", "ExportReport", "export_build"]


@dataclass
class ExportOptions:
    format: str  # a format that exports (builder/formats/registry.py)
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
    echo: Echo = quiet  # what the export says as it goes (a pause for space, a stall, its end); silent by default

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
    exported: int = 0  # sample files written by this call (added + rewritten + repaired)
    already: int = 0  # samples whose file was kept (not rewritten; maybe renumbered)
    added: list[str] = field(default_factory=list)  # samples new to the export
    rewritten: list[str] = field(default_factory=list)  # samples whose stored states or tokens changed
    repaired: list[str] = field(default_factory=list)  # samples whose file in OUT was not whole (checksum): rewritten
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
    recorded: bool = True  # an `export` event is in the build's log; False: the build cannot be written (read-only)

    def as_dict(self) -> dict:
        return asdict(self)


def export_build(build: str | Path, out: str | Path, opts: ExportOptions) -> ExportReport:
    lay = layout(build).require()
    fmt = make_format(opts.format, exports=True, max_len=opts.max_len, compress=opts.compress)
    info = BuildInfo.load(lay)
    if fmt.states:
        info.require(fmt.final_state)
    out = Path(out).absolute()
    if out == lay.root or lay.root in out.parents:
        raise UsageError(f"{out}: inside the build; export to a directory outside {lay.root}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; choose a directory for the export")
    check_target(out)
    if opts.limit is not None and opts.limit < 1:
        raise UsageError(f"--limit {opts.limit}: must be at least 1")
    if opts.subset is not None:
        parse_subset(opts.subset)
    if opts.draft_vocab_size is not None and not 0 < opts.draft_vocab_size <= info.vocab_size:
        raise FormatError(f"--draft-vocab-size {opts.draft_vocab_size}: must be between 1 and the model's "
                          f"vocabulary size {info.vocab_size}")
    wm = (opts.watermarks or load_config(lay).watermarks).validate()
    export_id = uuid.uuid4().hex
    report = ExportReport(export_id, str(out), fmt.name, final_state=fmt.final_state if fmt.states else "",
                          layer_ids=info.layer_ids()[fmt.layer_convention][:-1] if fmt.states else [])
    t0 = time.monotonic()
    with ExitStack() as stack:
        # the owner session: lock, log, queries, stall watch and Ctrl-C (builder/log/session.py): the first SIGINT
        # or SIGTERM stops the export at the next file boundary (Interrupted), a second exits at once (resumable).
        # A build this process cannot write (read-only mount, no permission) is only read: no owner, the lock
        # held shared, nothing recorded in its log (export_readonly.py)
        session: OwnerSession | ReadOnlyBuild
        try:
            session = stack.enter_context(OwnerSession(lay, "export", export_id, take_over=opts.take_over,
                                                       echo=opts.echo))
        except BuildReadOnlyError:
            session = stack.enter_context(ReadOnlyBuild(lay, take_over=opts.take_over))
            report.recorded = False
        log = session.open()
        asked = opts.stop
        opts = replace(opts, stop=lambda: asked() or session.stop_requested > 0)
        session.status_fn = lambda: {"workers": 0, **log.progress()}
        sel = _selection(log, opts)
        head = _head(lay, opts, info)
        loaded = load_journal(out, head)
        if loaded is None and not any(e["state"] in LIVE for e in sel):
            raise FormatError(f"{lay.root}: no written samples to export"
                              + (f" in --subset {opts.subset}" if opts.subset else "")
                              + "; run `hsbuild run` first, or see `hsbuild status`")
        report.layer_flag = info.layer_flag(fmt.name) if fmt.states else None
        job = Reconcile(str(lay.root), out, fmt, info, SegmentReader(lay.data), opts, wm, report)
        job.view = ExportBuildView(lay, log.query_dicts, log.meta)
        job.lossy = lambda ids: export_lossy(out, info, lambda sql: log.query(sql)[1], ids, fmt.final_state)
        job.run(sel, head, loaded)
        report.seconds = time.monotonic() - t0
        left_out = [d["sample_id"] for d in report.not_exported]
        if not report.recorded:
            return report
        log.append([Event("export", run_id=export_id, detail=detail(
            out=str(out), format=fmt.name, options=opts.recorded(), selected=report.selected, rows=report.rows,
            exported=report.exported, already=report.already, added=len(report.added),
            rewritten=len(report.rewritten), repaired=len(report.repaired), removed=len(report.removed),
            renumbered=report.renumbered,
            not_exported=len(left_out), not_exported_ids=left_out[:100], bytes=report.bytes_written,
            damaged=[d["sample_id"] for d in report.damaged], complete=report.complete,
            layer_ids=report.layer_ids, final_state=report.final_state, pid=os.getpid()))])
    return report



def _selection(log: EventLog, opts: ExportOptions) -> list[dict]:
    """The samples this export covers, in export order: every sample but the retired ones, by source row, then
    --subset and --limit."""
    rows = log.query_dicts("SELECT sample_id, row_idx, fingerprint, state, error, segment, token_start, num_tokens, "
                           "checksums, source_tokens FROM samples WHERE state <> 'retired' "
                           "ORDER BY row_idx, sample_id")
    if opts.subset:
        n, t = parse_subset(opts.subset)
        rows = [r for r in rows if stable_part(r["sample_id"], t) == n - 1]
    if opts.limit is not None:
        rows = rows[: opts.limit]
    return rows



def _head(lay: BuildLayout, opts: ExportOptions, info: BuildInfo) -> dict:
    return {"hsbuild_export": JOURNAL_VERSION,
            "build": {"root": str(lay.root), "model": info.model, "aux_layers": list(info.aux_layers),
                      "final_state": info.final_state},
            "options": opts.recorded(), "layer_ids": info.layer_ids()}
