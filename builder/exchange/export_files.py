"""An export's files on disk (builder/exchange/export.py): its journal `OUT/hsbuild-export.json` (what it vouches
for, how it is read back and saved whole) and the writes every export file goes through (temp name, fsync,
rename: under its final name a file is whole).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import crc32c

from builder.errors import UsageError
from builder.formats.base import Streamed
from builder.fsutil import fsync_path, fsync_paths

JOURNAL = "hsbuild-export.json"
JOURNAL_VERSION = 2
TMP_SUFFIX = ".hsbuild-tmp"
STAGING = ".hsbuild-staging"  # files written or moved before their row's path is free
CRC32C = "crc32c:"  # a journal checksum's prefix (before it: blake2b-128, 32 hex digits)
STAGED_SUFFIX = ".hsbuild-staged"  # no trainer reads such a name (ModelOpt takes every *.pt under OUT)


@dataclass
class Entry:
    """What the journal vouches for: the sample's file at `path` holds the sample as of fingerprint `fp`, with
    these bytes (`sum`: `digest`'s CRC-32C, or a blake2b-128 in a journal from before it) and `size`. `at`: a move was under way, the file is at one of these paths."""

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
                and isinstance(v[3], int) and safe_rel(v[0])):
            return None
        at = v[4] if len(v) == 5 else None
        if at is not None and not (isinstance(at, list) and at and all(safe_rel(a) for a in at)):
            return None
        return cls(v[0], v[1], v[2], v[3], at)


def safe_rel(p: object) -> bool:
    return isinstance(p, str) and bool(p) and not p.startswith("/") and ".." not in p.split("/")


def digest(data: bytes | memoryview) -> str:
    """A file's checksum as the journal records it: `crc32c:` and its CRC-32C (the build's own check of its stored
    rows; 10+ GB/s, the GIL let go), which with the file's size tells a whole file from a changed one (random
    damage passes with odds of 2^-32, as a stored row's does)."""
    return f"{CRC32C}{crc32c.crc32c(data):08x}"


def file_digest(path: Path, like: str = CRC32C) -> str:
    """The checksum of the file at `path` as `digest` gives it, or, where `like` is a blake2b-128 (32 hex digits:
    what journals written before the CRC-32C recorded), its blake2b: an older export's files are still checked."""
    old = not like.startswith(CRC32C)
    h = hashlib.blake2b(digest_size=16) if old else None
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if h is not None:
                h.update(chunk)
            else:
                crc = crc32c.crc32c(chunk, crc)
    return h.hexdigest() if h is not None else f"{CRC32C}{crc:08x}"


def flags(options: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v is not None)


def is_temp(name: str) -> bool:
    return name.endswith(TMP_SUFFIX) or (name.startswith(".hsbuild-") and name.endswith(".tmp"))


def load_journal(out: Path, head: dict) -> dict | None:
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
            raise UsageError(f"{out}: holds an export of {was} made with `{flags(j.get('options') or {})}`; "
                             + ("run it again with exactly those flags, " if was == head["build"]["root"] else "")
                             + "or export into a new directory")
        return j
    if out.is_dir() and any(not is_temp(p.name) for p in out.iterdir()):
        raise UsageError(f"{out}: not empty and not an hsbuild export; export into a new or empty directory")
    return None


def atomic_json(path: Path, obj: dict) -> None:
    """Temp file, fsync, rename (`write_file`), then fsync the directory; a failed write leaves no temp file."""
    write_file(path, json.dumps(obj, separators=(",", ":")).encode())
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


def write_file(path: Path, data: bytes | Callable[[Path], None]) -> None:
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


class _Sink:
    """The binary file object a `Streamed` writes to: each piece written to `fd` and added to its CRC-32C."""

    def __init__(self, fd: int):
        self.fd, self.crc, self.size = fd, 0, 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.crc = crc32c.crc32c(view, self.crc)
        self.size += n
        while view:
            view = view[os.write(self.fd, view):]
        return n

    def flush(self) -> None:
        pass


def write_streamed(path: Path, streamed: Streamed) -> tuple[str, int]:
    """`write_file` of a `Streamed` (temp name, fsync, rename; a failed write leaves no temp file), its checksum
    made as it is written: the file's `digest` and size."""
    sink = _Sink(-1)

    def write(tmp: Path) -> None:
        sink.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            streamed.write(sink)  # type: ignore[arg-type]
        finally:
            os.close(sink.fd)

    write_file(path, write)
    return f"{CRC32C}{sink.crc:08x}", sink.size


def remove_temp_files(out: Path) -> None:
    for p in out.rglob("*"):
        if is_temp(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def remove_empty_folders(out: Path) -> None:
    """Remove every empty folder under OUT, deepest first (OUT stays), and make that durable: a fresh export
    has none, and one left by a killed run (the staging folder, a `rows_*` folder emptied by a renumbering) goes
    on the next run."""
    gone: set[str] = set()
    for d, _subdirs, files in os.walk(out, topdown=False):
        if d != str(out) and not files:
            try:
                os.rmdir(d)
            except OSError:  # not empty (a folder under it stayed): kept
                continue
            gone.add(os.path.dirname(d))
    fsync_paths(Path(p) for p in sorted(gone) if os.path.isdir(p))


def staged_path(sid: str, fp: str) -> str:
    return f"{STAGING}/{hashlib.blake2b(sid.encode(), digest_size=12).hexdigest()}.{fp[:16]}{STAGED_SUFFIX}"
