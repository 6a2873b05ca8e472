"""The mount table: which filesystem (type, source, options) holds a path. One parser for each of the kernel's
two formats (/proc/self/mountinfo, /proc/mounts), used by doctor (storage checks, lock safety) and by the stall
watch (which names the filesystem of a stalled write)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


@dataclass
class Mount:
    mount_point: str
    fstype: str
    source: str
    options: dict[str, str | None]  # mount options and superblock options together: {"ro": None, "vers": "4.2"}

    def as_dict(self) -> dict:
        return {"mount_point": self.mount_point, "fstype": self.fstype, "device": self.source,
                "options": ",".join(k if v is None else f"{k}={v}" for k, v in self.options.items())}


def _options(*texts: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for text in texts:
        for opt in filter(None, text.split(",")):
            k, eq, v = opt.partition("=")
            out[k] = v if eq else None
    return out


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/self/mountinfo lines: 'ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS'."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if not sep or len(a) < 6 or len(b) < 2:
            continue
        out.append(Mount(_unescape_mount(a[4]), b[0], _unescape_mount(b[1]), _options(a[5], b[2] if len(b) > 2 else "")))
    return out


def parse_mounts(text: str) -> list[Mount]:
    """/proc/mounts lines: 'SOURCE MOUNTPOINT FSTYPE OPTS 0 0' (options of mount and superblock merged)."""
    out = []
    for line in text.splitlines():
        p = line.split()
        if len(p) >= 3:
            out.append(Mount(_unescape_mount(p[1]), p[2], _unescape_mount(p[0]), _options(p[3] if len(p) > 3 else "")))
    return out


def mount_entry(path: str | os.PathLike[str], mounts: list[Mount], resolve: bool = True) -> Mount | None:
    """The mount with the longest mount point that contains path (later entries over the same point win).
    `resolve` follows symlinks: a lookup, which hangs in a directory of a stalled volume where a create waits,
    so only where the volume is known to answer; else the path is taken as written."""
    real = os.path.realpath(path) if resolve else os.path.abspath(path)
    best, best_len = None, -1
    for m in mounts:
        mnt = m.mount_point
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= best_len:
            best, best_len = m, len(mnt)
    return best


def system_mounts() -> list[Mount]:
    """This process's mount table: /proc/self/mountinfo, else /proc/mounts, else none."""
    try:
        return parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        try:
            return parse_mounts(Path("/proc/mounts").read_text())
        except OSError:
            return []


def mount_of(path: str | os.PathLike[str], mounts_text: str | None = None, resolve: bool = True) -> Mount | None:
    """The mount holding `path`, from this process's table or from `mounts_text` (/proc/mounts format)."""
    return mount_entry(path, parse_mounts(mounts_text) if mounts_text is not None else system_mounts(), resolve)
