"""Read-only SQL over a build, live or not (the client side; the guard itself is in `sandbox`).

While a process owns the build (DuckDB lets no other process open the file, not even read-only), queries go
to the owner over its Unix socket (mode 0600, so only the same user can ask), which runs them on a snapshot
in a throwaway instance. Otherwise the file is opened read-only in a locked-down instance for the length of
the query, which gives way (is interrupted and re-asked of the owner) as soon as an owner takes the build.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import duckdb

from builder.errors import BuildLockedError, QueryError, ReadOnlyQueryError
from builder.layout import BuildLayout
from builder.log.events import EventLog
from builder.log.lock import LockState, inspect_lock, socket_path_for
from builder.log.sandbox import (
    MAX_TIMEOUT_S,
    QUERY_TIMEOUT_S,
    QueryInterrupted,
    arrow_file,
    queries_file,
    query_file,
)

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
OWNER_WAIT_S = 10.0  # how long a client waits for an owner that holds the lock but does not answer yet
# how long `status` waits for an owner that answers but is still starting (no log open yet: reading a big source
# takes minutes) before it shows that owner's phase instead of its progress
STATUS_START_WAIT_S = 2.0
# how long `status` waits for the owner's answer: it computes a fresh one for up to 8 s while its log answers
# (log/session.py STATUS_MAX_WAIT_S), then answers from its last figures, with their age
STATUS_ASK_S = 12.0


_parser_lock = threading.Lock()
_parser: duckdb.DuckDBPyConnection | None = None  # an empty in-memory instance, for parsing only


def _statements(sql: str) -> list:
    """`sql`'s statements, parsed (not run) by one empty in-memory DuckDB kept for that: a new instance costs
    ~14 ms of CPU, paid by every query an owner answers and every client's, where polling asks many."""
    global _parser  # noqa: PLW0603
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect()
        return _parser.extract_statements(sql)


def check_read_only(sql: str) -> None:
    """Friendlier messages for statements that obviously write. Not the guard: see `sandbox`."""
    try:
        statements = _statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from e
    if not statements:
        raise QueryError("no SQL statement given")
    if len(statements) > 1:
        raise ReadOnlyQueryError("give one statement at a time")
    kind = statements[0].type
    if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs its statement: name what that would be
        inner = re.sub(r"^\s*EXPLAIN\s+(\([^)]*\)\s*)?(ANALY[SZ]E\s+)?", "", sql, flags=re.IGNORECASE)
        try:
            kind = _statements(inner)[0].type
        except (duckdb.Error, IndexError):
            pass  # the structural guard still holds
        kind = duckdb.StatementType.SELECT if kind == duckdb.StatementType.EXPLAIN else kind
    if kind not in ALLOWED:
        name = getattr(kind, "name", str(kind))
        raise ReadOnlyQueryError(
            f"refused: {name} statements would change the build; `hsbuild sql` is read-only (SELECT only)"
        )


def check_timeout(timeout: float) -> float:
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise QueryError(f"--timeout {timeout:g}: give seconds between 0 and {MAX_TIMEOUT_S:g}")
    return float(timeout)


def jsonable(v: object) -> object:
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return v


# ---------------------------------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------------------------------


def send_request(sock_path: Path, request: dict, timeout: float) -> socket.socket:
    """A connection to the owner's socket with `request` sent on it (one JSON line); the caller reads the reply
    and closes it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sock_path))
        s.sendall(json.dumps(request).encode() + b"\n")
    except BaseException:
        s.close()
        raise
    return s


def ask_owner(sock_path: Path, request: dict, timeout: float = 2.0) -> dict:
    s = send_request(sock_path, request, timeout)
    try:
        line = recv_line(s)
        if not line:
            raise ConnectionResetError("the owner closed the connection without answering")
        return json.loads(line)
    finally:
        s.close()


def recv_line(s: socket.socket) -> bytes:
    """One newline-terminated message (the query protocol: one JSON line each way)."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _sockets(lay: BuildLayout, st: LockState) -> list[Path]:
    """Where the owner may answer: the socket its lock record names, and the deterministic path (which still
    works when the lock file was deleted or its record is missing)."""
    out = []
    if st.info and st.info.get("socket"):
        out.append(Path(st.info["socket"]))
    fixed = socket_path_for(lay)
    if fixed not in out:
        out.append(fixed)
    return out


def request(lay: BuildLayout, req: dict, wait: float = OWNER_WAIT_S, timeout: float = 2.0,
            start_wait: float | None = None, ask: Callable[[Path, dict, float], dict] = ask_owner) -> dict | None:
    """Ask the live owner, if any. Returns None when no process owns the build. An owner that does not answer is
    waited for `wait` s; one that answers it is still starting, `start_wait` s (default: `wait`), then its
    answer is returned as it is.

    A reply reached although the lock file is missing (or not held) carries `lock_file_missing` /
    `lock_not_held`: something deleted or replaced hsbuild.lock under a live owner."""
    t0 = time.monotonic()
    deadline = t0 + wait
    start_deadline = t0 + (wait if start_wait is None else start_wait)
    while True:
        st = inspect_lock(lay)
        for sock in _sockets(lay, st):
            if not st.held and not sock.exists():
                continue
            try:
                reply = ask(sock, req, timeout)
            except (ConnectionRefusedError, FileNotFoundError):
                continue  # a stale socket file, or not listening yet
            except (TimeoutError, OSError):
                continue
            if reply.get("starting") and time.monotonic() < start_deadline:  # no log open yet: ask again shortly
                break
            if not st.held and not inspect_lock(lay).held:  # (not an owner that took the lock just now)
                reply["lock_file_missing" if st.missing else "lock_not_held"] = True
            return reply
        if not st.held:
            return None
        if time.monotonic() > deadline:
            who = st.info or {}
            return {"ok": False, "error": f"the {who.get('purpose', 'process')} that owns this build (pid "
                    f"{who.get('pid', '?')}) did not answer within {wait:.0f} s (an hsbuild of another version, or a "
                    "process stuck in the kernel); `hsbuild doctor` tells more"}
        time.sleep(0.1)


def _raise_reply(reply: dict) -> None:
    if not reply.get("ok"):
        msg = reply.get("error", "query failed")
        raise ReadOnlyQueryError(msg) if reply.get("kind") == "ReadOnlyQueryError" else QueryError(msg)


def _ask_or_read(lay: BuildLayout, req: dict, offline: Callable[[], object], timeout: float = 10.0,
                 ask_timeout: float = 2.0, wait: float = OWNER_WAIT_S, start_wait: float | None = None,
                 ask: Callable[[Path, dict, float], dict] = ask_owner) -> dict:
    """Ask the live owner; with none, read the file. Handles a run that starts between the two, or during
    the read (the read gives way and the owner is asked)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = request(lay, req, wait=wait, timeout=ask_timeout, start_wait=start_wait, ask=ask)
        if reply is not None and reply.get("closing") and time.monotonic() < deadline:
            time.sleep(0.1)  # the owner stopped the query to close its log: the file answers once it is closed
            continue
        if reply is not None:
            _raise_reply(reply)
            return reply
        try:
            return {"offline": offline()}
        except QueryInterrupted as e:
            if e.reason != "asked":
                raise
        except BuildLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stale_note(stall: dict, as_of: float | None) -> str:
    """What an owner's answer from an older snapshot of its log comes with: why, and how old that snapshot is."""
    when = "" if as_of is None else (f" as of {time.strftime('%H:%M:%S', time.localtime(as_of))} "
                                     f"({max(time.time() - as_of, 0.0):.1f} s ago)")
    if not stall.get("early"):
        return (f"STALLED: {stall['what']} pending {stall['pending_s']:.0f} s on {stall['path']} "
                f"({stall['filesystem']}): answered from the log as of the stall's start")
    if stall.get("held", True):
        return (f"note: answered from the owner's last snapshot of the log{when}: a commit to it has been pending "
                f"{stall.get('pending_s', 0):.1f} s (not returned yet)")
    return (f"note: answered from the owner's last snapshot of the log{when}: a fresh one took longer than the "
            "query's --timeout")


def run_query(lay: BuildLayout, sql: str, timeout: float = QUERY_TIMEOUT_S,
              on_note: Callable[[str], None] | None = None) -> tuple[list[str], list[list]]:
    """Run one read-only statement against a build; returns (columns, rows) with JSON-able values. The
    query is stopped after `timeout` seconds; an owner that is still starting is waited for within it.
    `on_note` hears what the answer comes with (the owner's storage stalled: answered from its last snapshot)."""
    check_read_only(sql)
    timeout = check_timeout(timeout)

    def offline() -> tuple[list[str], list[tuple]]:
        return query_file(lay.events, sql, timeout, interrupt_if=lambda: inspect_lock(lay).held)

    reply = _ask_or_read(lay, {"op": "sql", "sql": sql, "timeout": timeout}, offline, timeout=10.0,
                         ask_timeout=timeout + 10.0, wait=max(OWNER_WAIT_S, timeout))
    if "offline" in reply:
        cols, rows = reply["offline"]
        return cols, [[jsonable(v) for v in r] for r in rows]
    stall = reply.get("stalled")
    if stall and on_note is not None:
        on_note(stale_note(stall, reply.get("as_of")))
    return reply["columns"], reply["rows"]


def run_queries(lay: BuildLayout, statements: list[str],
                timeout: float = QUERY_TIMEOUT_S) -> list[tuple[list[str], list[list]]]:
    """`run_query` for several statements at once (hsbuild's own: the report's series): with no owner, all from
    one read-only open of the file (one state of it); with a live owner (or one that takes the build meanwhile),
    each asked of it."""
    for sql in statements:
        check_read_only(sql)
    timeout = check_timeout(timeout)
    if not inspect_lock(lay).held:
        try:
            got = queries_file(lay.events, statements, timeout, interrupt_if=lambda: inspect_lock(lay).held)
            return [(cols, [[jsonable(v) for v in r] for r in rows]) for cols, rows in got]
        except QueryInterrupted as e:
            if e.reason != "asked":
                raise
        except BuildLockedError:
            pass  # an owner took the build: asked of it below
    return [run_query(lay, sql, timeout) for sql in statements]


def read_columns(lay: BuildLayout, statements: list[str], timeout: float = QUERY_TIMEOUT_S) -> tuple[str, list]:
    """hsbuild's own bulk read of a build's log (the reader's index): each statement's result as an Arrow table,
    all from one state of the log: ("file", tables) read from the file with no owner, ("owner", tables) asked of
    a live owner (its `arrow` op, builder/log/bulk.py: one snapshot of its replica). SELECT only, run where user
    SQL runs (sandbox)."""
    from builder.log.bulk import ask_owner_arrow  # noqa: PLC0415 (bulk imports this module)

    for sql in statements:
        check_read_only(sql)
    timeout = check_timeout(timeout)

    def offline() -> list:
        return arrow_file(lay.events, statements, timeout, interrupt_if=lambda: inspect_lock(lay).held)

    reply = _ask_or_read(lay, {"op": "arrow", "statements": statements, "timeout": timeout}, offline, timeout=10.0,
                         ask_timeout=timeout + 10.0, wait=max(OWNER_WAIT_S, timeout), ask=ask_owner_arrow)
    if "offline" in reply:
        return "file", reply["offline"]
    return "owner", reply["tables"]


def status_snapshot(lay: BuildLayout, offline_extra: Callable[[EventLog, dict], dict] | None = None) -> dict:
    """Progress plus live state (paused, free space, ...) from the owner, or from the file when idle. With no
    owner, `offline_extra(log, progress)` adds what the owner would have (e.g. the capacity projection) from
    the same open log."""

    def offline() -> dict:
        with EventLog(lay.events, read_only=True) as log:
            prog = log.progress()
            return {**prog, **(offline_extra(log, prog) if offline_extra is not None else {})}

    reply = _ask_or_read(lay, {"op": "status"}, offline, start_wait=STATUS_START_WAIT_S, ask_timeout=STATUS_ASK_S)
    if "offline" in reply:
        return {"running": False, **{k: jsonable(v) for k, v in reply["offline"].items()}}
    st = dict(reply["status"])
    for flag in ("lock_file_missing", "lock_not_held"):
        if reply.get(flag):
            st[flag] = True
    return st
