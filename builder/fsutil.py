"""Small durability helpers: fsync of files and directories, atomic temp-file-then-rename writes."""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_POOL: ThreadPoolExecutor | None = None


def fsync_paths(paths: Iterable[Path]) -> None:
    """fsync many files/directories concurrently (the device merges the flushes; fsync releases the GIL).

    Files before directories is not needed for correctness here: the caller commits nothing until all return.
    """
    global _POOL
    unique = list(dict.fromkeys(paths))
    if len(unique) <= 2:
        for p in unique:
            fsync_path(p)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hsbuild-fsync")
    for _ in _POOL.map(fsync_path, unique):
        pass


def make_dirs_durable(path: Path) -> None:
    """mkdir -p, with each directory it creates made durable (its parent fsynced after the mkdir)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        fsync_path(d.parent)
    if not missing:
        fsync_path(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total
