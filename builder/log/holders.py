"""Who holds the event log's file when DuckDB cannot open it: named in the error, never guessed (design.md
section 6, "The log file")."""

from __future__ import annotations

import re
from pathlib import Path

from builder.errors import BuildLockedError


def describe_pid(pid: int) -> str:
    """'pid N (command line)' for a message, as far as /proc tells."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    if len(cmd) > 100:
        cmd = cmd[:97] + "..."
    return f"pid {pid}" + (f" ({cmd})" if cmd else "")


def _holder(message: str) -> str:
    """Who DuckDB says holds the file ('Conflicting lock is held in /usr/bin/python3 (PID 123) ...')."""
    m = re.search(r"\(PID (\d+)\)", message)
    return describe_pid(int(m.group(1))) if m else "another process"


def locked_error(path: Path, read_only: bool, message: str) -> BuildLockedError:
    """The error for a log file DuckDB found locked, naming the process that holds it (`message`: DuckDB's)."""
    who = _holder(message)
    if read_only:
        return BuildLockedError(
            f"{path}: the event log is held by {who}, which owns the build (a run, verify or gc is "
            "going); use `hsbuild status` / `hsbuild sql`, which ask that process, or wait for it to finish")
    # every writer takes the build lock first, so what holds the file now is normally a reader
    return BuildLockedError(
        f"{path}: the event log is held by {who}, and a writer needs it alone (readers let go: `hsbuild "
        "sql` and `status` at once, a training job or a DuckDB shell when it closes the file); try again, or "
        "stop that process")
