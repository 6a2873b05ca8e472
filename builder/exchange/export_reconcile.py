"""One run of an export (builder/exchange/export.py, whose docstring gives the write order): survey what OUT
holds, write what is new or changed, lay the rows out, write the dataset-wide files, mark the journal finished."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from builder.config import Watermarks
from builder.errors import (
    DamagedSampleError,
    DiskFullError,
    Interrupted,
    UsageError,
    is_no_space,
)
from builder.exchange import export_space
from builder.exchange.export_files import (
    JOURNAL,
    JOURNAL_VERSION,
    STAGING,
    Entry,
    atomic_json,
    digest,
    file_digest,
    remove_empty_folders,
    remove_temp_files,
    safe_rel,
    staged_path,
    write_file,
)
from builder.exchange.export_space import bytes_per_token, preflight
from builder.exchange.export_writers import Writers, Written, size_of
from builder.formats.base import BuildView, Exported, Rejected, Sample, TrainerFormat
from builder.formats.build_info import BuildInfo
from builder.fsutil import fsync_path, fsync_paths
from builder.progress import NoProgress
from builder.store.reader import SegmentReader
from builder.store.segment import FIELDS

if TYPE_CHECKING:
    from builder.exchange.export import ExportOptions, ExportReport

LIVE = ("written", "verified")
NO_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)  # OUT cannot be written: a usage error
SAVE_EVERY_S = 2.0  # the journal vouches for new files at least this often (and at most 10% of the time)
HASH_THREADS = min(8, os.cpu_count() or 1)  # kept files checked side by side on a re-run
TOKEN_CACHE = 1 << 24  # tokens (ids and mask) kept from the first read for the dataset-wide files; beyond: read again
COUNT_BATCH = 512  # samples whose loss-masked tokens are counted together
READ_BATCH = 256  # samples read together (SegmentReader.read_many)...
READ_BYTES = 32 << 20  # ... and about this many bytes of their states, READ_AHEAD batches read ahead
READ_AHEAD = 2
TEXT_BYTES_PER_TOKEN = 16  # a format of text (no states, `TrainerFormat.states` False): its files, about, a token


def _fingerprint(e: dict) -> str:
    """Changes when the sample's source tokens change or its states are written again (another segment, offset,
    length or checksums): what decides whether an exported file still holds the sample."""
    key = json.dumps([e["fingerprint"], e["segment"], int(e["token_start"]), int(e["num_tokens"]), e["checksums"]])
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _not_written(e: dict) -> dict:
    state, err = e["state"], e.get("error")
    if state == "failed":
        msg = f"failed ({err})" + ("; its stored bytes are damaged" if err in ("checksum_mismatch", "missing_data",
                                                                              "unreadable") else "")
        return {"sample_id": e["sample_id"], "state": state, "reason": err or "failed", "message": msg}
    msg = "a run stopped while extracting it" if state == "started" else "not extracted yet"
    return {"sample_id": e["sample_id"], "state": state, "reason": "not_written", "message": msg}


def _count(freq: Counter[int], masked: list[np.ndarray]) -> None:
    """Add the loss-masked tokens of some samples to `freq` (and forget them)."""
    if not masked:
        return
    tokens, counts = np.unique(np.concatenate(masked), return_counts=True)
    masked.clear()
    freq.update(dict(zip(tokens.tolist(), counts.tolist(), strict=True)))


class Reconcile:
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
        self.masked: list[np.ndarray] = []  # loss-masked tokens of the samples kept since `freq` last counted
        self.unproven: dict[str, str] = {}  # sample id -> fingerprint: vouched for, but its file is not whole
        self.unsaved: list[str] = []  # sample ids whose files were written since the last save, in order
        self.vouched = 0  # the files the journal on disk vouches for
        self.view: BuildView | None = None  # the build, for a format that asks more of it (TrainerFormat.prepare)

    # -- the journal ---------------------------------------------------------------------------------------------

    def save(self, finished: bool = False, selection: list[str] | None = None) -> None:
        """Make what the files say durable (fsync the directories renamed into), then rewrite the journal."""
        if self.dirty_dirs:
            fsync_paths(self.dirty_dirs)
            self.dirty_dirs.clear()
        t = time.monotonic()
        atomic_json(self.out / JOURNAL, {
            **self.head, "updated_at": time.time(), "finished": finished,
            "complete": finished and self.report.complete, "selection": selection,
            "files": {sid: en.dump() for sid, en in self.entries.items()}, "finish": self.finish_rec,
            "report": self.report.as_dict() if finished else None})
        self.on_disk = {p for en in self.entries.values() for p in (en.at or [en.path])}
        self.vouched, self.unsaved = len(self.entries), []
        self.save_cost = time.monotonic() - t
        self.next_save = time.monotonic() + max(SAVE_EVERY_S, 10 * self.save_cost)

    def _holds(self, rel: str, size: int, checksum: object) -> bool:
        """The file at `rel` is the one vouched for: a regular file of `size` bytes whose checksum is `checksum`
        (`export_files.digest`'s; read whole: a re-run reads each file it keeps once)."""
        path = self.out / rel
        try:
            st = os.stat(path)
            return stat.S_ISREG(st.st_mode) and st.st_size == size and file_digest(path, str(checksum)) == checksum
        except OSError:
            return False

    def survey(self, j: dict) -> None:
        """The journal's entries whose files are where it says, whole: a regular file of its size and checksum
        (a file in doubt: at one of the paths it may be at). The others are written again (`unproven`)."""
        files = j.get("files") if j.get("hsbuild_export") == JOURNAL_VERSION else None
        raw = files if isinstance(files, dict) else {}
        loaded = {sid: Entry.load(v) for sid, v in raw.items()}
        plain = [(sid, en) for sid, en in loaded.items() if en is not None and en.at is None]
        with ThreadPoolExecutor(HASH_THREADS) as pool:  # hashlib lets go of the GIL: files hashed side by side
            whole = list(pool.map(lambda item: self._holds(item[1].path, item[1].size, item[1].sum), plain))
        claimed: set[str] = set()
        for (sid, en), ok in zip(plain, whole, strict=True):
            if ok and en.path not in claimed:
                self.entries[sid] = en
                claimed.add(en.path)
        for sid, en in loaded.items():
            if en is None or en.at is None:
                continue
            for cand in en.at:
                if cand not in claimed and self._holds(cand, en.size, en.sum):
                    self.entries[sid] = Entry(cand, en.fp, en.sum, en.size)
                    claimed.add(cand)
                    break
        self.unproven = {sid: en.fp for sid, en in loaded.items() if en is not None and sid not in self.entries}
        self.vouched = len(self.entries)
        self.on_disk = {p for en in loaded.values() if en is not None for p in (en.at or [en.path])}
        fin = j.get("finish") if isinstance(j.get("finish"), dict) else {}
        files_ok = isinstance(fin.get("files"), dict) and all(
            isinstance(v, list) and len(v) == 2 and safe_rel(k) for k, v in fin["files"].items())
        self.finish_rec = {"key": fin.get("key"), "files": fin["files"] if files_ok else {}}

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self, sel: list[dict], head: dict, j: dict | None) -> None:
        try:
            self._run(sel, head, j)
        except OSError as e:
            if isinstance(e, DamagedSampleError):
                raise
            if e.errno in NO_WRITE:
                raise UsageError(f"{self.out}: cannot write {e.filename or self.out} ({e.strerror}); make it "
                                 "writable or export elsewhere (the same command continues from what its journal "
                                 "kept)") from None
            if not is_no_space(e):
                raise
            if self.head:
                self._save_on_a_full_volume()
            raise DiskFullError(f"{self.out}: its volume is full ({os.strerror(e.errno)}) after {self.report.exported} "
                                f"sample file(s) written, {self.vouched} kept by its journal; free space there and "
                                "run the same command again: it keeps those and continues") from None

    def _save_on_a_full_volume(self) -> None:
        """Save the journal on a full volume: where it has no room (a file, or an inode), give up the files
        written since the last save, newest first, one at a time, until it has: the files the journal then
        vouches for are kept by the next run, instead of none since the last save."""
        while True:
            try:
                self.save()
                return
            except OSError as e:
                if not is_no_space(e) or not self.unsaved:
                    return  # (the journal on disk still vouches for what it did)
            en = self.entries.pop(self.unsaved.pop())
            (self.out / en.path).unlink(missing_ok=True)

    def _run(self, sel: list[dict], head: dict, j: dict | None) -> None:
        out, fmt, rep = self.out, self.fmt, self.report
        created = j.get("created_at") if j else None
        if j is not None:
            self.survey(j)
        prior = set(self.entries) | set((j or {}).get("files") or {})
        rep.selected = len(sel)
        live = [e for e in sel if e["state"] in LIVE]
        rep.not_exported = [_not_written(e) for e in sel if e["state"] not in LIVE]
        refused = self.fmt.prepare(self.view, live) if self.view is not None else {}  # (FormatError: nothing written)
        for e in live:
            if e["sample_id"] in refused:
                self._refused(e["sample_id"], refused[e["sample_id"]])
        live = [e for e in live if e["sample_id"] not in refused]
        fps = {e["sample_id"]: _fingerprint(e) for e in live}
        kept = {e["sample_id"] for e in live if e["sample_id"] in self.entries
                and self.entries[e["sample_id"]].fp == fps[e["sample_id"]]}
        todo = [e for e in live if e["sample_id"] not in kept]

        per_token = bytes_per_token(self.info) if fmt.states else TEXT_BYTES_PER_TOKEN
        preflight(out, sum(int(e["num_tokens"]) for e in todo) * per_token, self.wm, self.opts)
        self.head = {**head, "created_at": created or time.time()}
        if j is None:
            new_dir = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            if new_dir:
                fsync_path(out.parent)
        remove_temp_files(out)
        self.save()  # never vouch on disk for more than is there; not finished while this run changes OUT

        # 2. the kept samples' tokens (the dataset-wide files need them; a damaged one leaves the export)
        freq: Counter[int] = Counter()
        damaged: set[str] = set()
        for e, got in self._reads([e for e in live if e["sample_id"] in kept], tokens_only=True):
            if self.opts.stop():
                raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
            if isinstance(got, DamagedSampleError):
                self._damaged(e["sample_id"], got, damaged)
                continue
            self._keep(e["sample_id"], got["input_ids"], got["loss_mask"], freq)

        # 2. the new and changed samples, each to its row's path when nothing vouched for is there (written side
        # by side: export_writers.py; the journal vouches for a file once its write has returned)
        self.progress.start(len(todo), f"export {fmt.name}")
        rows_at = {}  # sample id -> its row (the kept samples before it, damaged aside, and the written ones)
        row = 0
        for e in live:
            sid = e["sample_id"]
            if sid in kept:
                row += sid not in damaged
                continue
            rows_at[sid] = row
            row += 1  # (one that turns out damaged or refused is taken back below)
        shift = 0  # samples of `todo` before this one that were left out
        occupied = self.on_disk | {en.path for en in self.entries.values()}
        writers = Writers(out, lambda w: self._written(w, fps, prior))
        try:
            for e, got in self._reads(todo, tokens_only=not fmt.states):
                sid = e["sample_id"]
                if self.opts.stop():
                    writers.drain()
                    self.save()
                    raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")
                index = rows_at[sid] - shift
                s = None if isinstance(got, DamagedSampleError) else self._sample(e, index, got)
                if s is None:
                    self._damaged(sid, got, damaged)  # type: ignore[arg-type]
                    shift += 1
                    self.progress.update(done=1, note="damaged")
                    continue
                try:
                    data = fmt.sample_bytes(s)
                except Rejected as why:  # the format cannot export this one (it says why): left out, named
                    self._refused(sid, why)
                    damaged.add(sid)
                    shift += 1
                    self.progress.update(done=1, note="refused")
                    continue
                target = fmt.sample_path(index, sid)
                rel = target if target not in occupied else staged_path(sid, fps[sid])
                rep.pauses += export_space.wait_for_space(out, size_of(data), self.wm, self.opts, self.progress,
                                                          writers.pending_bytes, writers.drain)
                occupied.add(rel)
                writers.submit((sid, s.num_tokens), rel, data)
                self._keep(sid, s.input_ids.numpy(), s.loss_mask.numpy(), freq)
                if time.monotonic() >= self.next_save:
                    writers.collect()
                    self.save()
                    occupied = self.on_disk | {en.path for en in self.entries.values()} | writers.pending_paths()
            writers.drain()
        except BaseException:
            with contextlib.suppress(Exception):  # the files written before the failure: vouched for by the save
                writers.drain()
            raise
        finally:
            writers.close()
        self.progress.close()

        # 3. the layout: row i at its path; nothing else that a trainer would read as a sample
        rows = [e for e in live if e["sample_id"] in self.entries and e["sample_id"] not in damaged
                and self.entries[e["sample_id"]].fp == fps[e["sample_id"]]]
        self._layout(rows, kept)
        remove_empty_folders(out)  # those this run emptied, and those a killed one left: a fresh export has none
        if self.opts.stop():
            raise Interrupted(f"export into {out} interrupted; run the same command again to finish it")

        # 4. the dataset-wide files, the journal finished
        _count(freq, self.masked)
        self._finish(rows, freq)
        rep.removed.sort()
        self._close(live)

    def _keep(self, sid: str, ids: np.ndarray, mask: np.ndarray, freq: Counter[int]) -> None:
        """Count the sample's loss-masked tokens (COUNT_BATCH samples at a time); keep its tokens for the
        dataset-wide files while there is room."""
        self.masked.append(np.asarray(ids)[np.asarray(mask) != 0])
        if len(self.masked) >= COUNT_BATCH:
            _count(freq, self.masked)
        if self.cached + len(ids) <= TOKEN_CACHE:
            self.tokens[sid] = (np.asarray(ids), np.asarray(mask))  # as stored (int32, uint8): ~5 bytes a token
            self.cached += len(ids)

    def _damaged(self, sid: str, err: DamagedSampleError, damaged: set[str]) -> None:
        d = {"sample_id": sid, "state": "damaged", "reason": err.reason,
             "message": str(err.with_context(sid, self.build))}
        self.report.damaged.append(d)
        self.report.not_exported.append(d)
        damaged.add(sid)

    def _refused(self, sid: str, why: Rejected) -> None:
        self.report.not_exported.append({"sample_id": sid, "state": "refused", "reason": why.reason,
                                         "message": str(why)})

    def _reads(self, entries: list[dict], tokens_only: bool) -> Iterator[tuple[dict, dict | DamagedSampleError]]:
        """Each sample of `entries` with what its stored arrays read as (tensors; numpy tokens and mask only when
        `tokens_only`), or the damage found, in order: batches of READ_BATCH samples and about READ_BYTES of states
        (`SegmentReader.read_many`), the next READ_AHEAD read on threads (decoding lets go of the GIL) meanwhile."""
        fields = ("input_ids", "loss_mask") if tokens_only else FIELDS
        per_token = 5 if tokens_only else bytes_per_token(self.info)
        batches: list[list[dict]] = [[]]
        size = 0
        for e in entries:
            if len(batches[-1]) >= READ_BATCH or size >= READ_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(e)
            size += int(e["num_tokens"]) * per_token

        def read(batch: list[dict]) -> list[dict | DamagedSampleError]:
            return self.reader.read_many([(b["segment"], b["token_start"], b["num_tokens"], b["checksums"])
                                          for b in batch], fields=fields, tensors=not tokens_only)
        pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="hsbuild-export-read")
        try:
            ahead = deque(pool.submit(read, b) for b in batches[:READ_AHEAD])
            for k, batch in enumerate(batches):
                got = ahead.popleft().result()
                if k + READ_AHEAD < len(batches):
                    ahead.append(pool.submit(read, batches[k + READ_AHEAD]))
                yield from zip(batch, got, strict=True)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _sample(self, e: dict, index: int, t: dict) -> Sample:
        if not self.fmt.states:  # a format of text: the tokens and mask only
            import torch  # noqa: PLC0415

            return Sample(e["sample_id"], int(e["row_idx"]), index,
                          torch.from_numpy(t["input_ids"].astype(np.int64)),
                          torch.from_numpy(t["loss_mask"].astype(np.int64)), torch.empty(0), torch.empty(0))
        return Sample(e["sample_id"], int(e["row_idx"]), index, t["input_ids"].long(), t["loss_mask"].long(),
                      t["aux_hidden_state"], self.info.final(t["hidden_state"], self.fmt.final_state))

    def _written(self, w: Written, fps: dict[str, str], prior: set[str]) -> None:
        """A file whose write returned (fsynced, renamed): vouched for by the journal's next save."""
        sid, tokens = w.key  # type: ignore[misc]
        rep = self.report
        self.entries[sid] = Entry(w.rel, fps[sid], w.sum, w.size)
        self.dirty_dirs.add((self.out / w.rel).parent)
        self.unsaved.append(sid)
        if self.unproven.get(sid) == fps[sid]:  # the same sample: its file in OUT was damaged or lost
            rep.repaired.append(sid)
        else:
            (rep.rewritten if sid in prior else rep.added).append(sid)
        rep.exported += 1
        rep.bytes_written += w.size
        self.progress.update(done=1, tokens=tokens, nbytes=w.size)

    def _sample_files_on_disk(self) -> set[str]:
        """Every file under OUT that the trainer would read as a sample, and every staged file."""
        found = {str(p)[len(str(self.out)) + 1:] for p in self.fmt.scan(self.out)} if self.out.is_dir() else set()
        staging = self.out / STAGING
        if staging.is_dir():
            found |= {p.relative_to(self.out).as_posix() for p in staging.iterdir() if p.is_file()}
        return found

    def _layout(self, rows: list[dict], kept: set[str]) -> None:
        out, rep = self.out, self.report
        target = {e["sample_id"]: self.fmt.sample_path(i, e["sample_id"]) for i, e in enumerate(rows)}
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
            staged = staged_path(sid, en.fp)
            en.at = list(dict.fromkeys([en.path, staged, target[sid]]))
        self.save()  # the leaving ones no longer vouched for; the moving ones in doubt
        touched: set[Path] = set()
        for rel in dict.fromkeys(gone + strays):
            if rel not in staying:
                (out / rel).unlink(missing_ok=True)
                touched.add((out / rel).parent)
        for sid in movers:  # through the staging folder: a row's path is free once everything has left it
            en = self.entries[sid]
            staged = staged_path(sid, en.fp)
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

    def _finish_key(self, rows: list[dict], fps: dict[str, str]) -> str:
        key = json.dumps([[e["sample_id"], fps[e["sample_id"]]] for e in rows] + [self.opts.draft_vocab_size])
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def _finish(self, rows: list[dict], freq: Counter[int]) -> None:
        """The dataset-wide files: token frequencies over loss-masked tokens (what every trainer builds its
        reduced draft vocabulary from), the vocab mapping, and any index of the rows (read again, tokens and mask
        only), each written again only when the rows changed."""
        out, fmt, info = self.out, self.fmt, self.info
        fps = {e["sample_id"]: self.entries[e["sample_id"]].fp for e in rows}
        key = self._finish_key(rows, fps)
        rec = self.finish_rec
        if rec.get("key") == key and all(self._holds(rel, v[1], v[0]) for rel, v in rec["files"].items()):
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
            write_file(out / rel, data)
            if callable(data):
                written[rel] = [file_digest(out / rel), (out / rel).stat().st_size]
            else:
                written[rel] = [digest(data), len(data)]
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
