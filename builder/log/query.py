"""Read-only SQL over a build, live or not.

While a process owns the build (DuckDB lets no other process open the file, not even read-only), queries go
to the owner over its Unix socket (mode 0600, so only the same user can ask). Otherwise the file is opened
read-only. Either way only SELECT-like statements are accepted.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import socket
import time
import uuid
from pathlib import Path

import duckdb

from builder.errors import BuildLockedError, QueryError, ReadOnlyQueryError
from builder.layout import BuildLayout
from builder.log.events import EventLog
from builder.log.lock import inspect_lock

ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def check_read_only(sql: str) -> None:
    try:
        statements = duckdb.connect().extract_statements(sql)
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from e
    if not statements:
        raise QueryError("no SQL statement given")
    if len(statements) > 1:
        raise ReadOnlyQueryError("give one statement at a time")
    kind = statements[0].type
    if kind not in ALLOWED:
        name = getattr(kind, "name", str(kind))
        raise ReadOnlyQueryError(
            f"refused: {name} statements would change the build; `hsbuild sql` is read-only (SELECT only)"
        )


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


def ask_owner(sock_path: Path, request: dict, timeout: float = 2.0) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sock_path))
        s.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(recv_line(s))
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


def _live_socket(lay: BuildLayout) -> Path | None:
    st = inspect_lock(lay)
    if st.held and st.info and st.info.get("socket"):
        return Path(st.info["socket"])
    return None


def request(lay: BuildLayout, req: dict, wait: float = 3.0) -> dict | None:
    """Ask the live owner, if any. Returns None when no process owns the build."""
    deadline = time.monotonic() + wait
    while True:
        sock = _live_socket(lay)
        if sock is None:
            if not inspect_lock(lay).held:
                return None
        else:
            try:
                return ask_owner(sock, req)
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError, OSError):
                pass
        if time.monotonic() > deadline:
            return {"ok": False, "error": "the process that owns this build does not answer queries; try again"}
        time.sleep(0.1)


def _ask_or_read(lay: BuildLayout, req: dict, offline, timeout: float = 10.0):
    """Ask the live owner; with none, read the file. Handles a run that starts between the two."""
    deadline = time.monotonic() + timeout
    while True:
        reply = request(lay, req)
        if reply is not None:
            if not reply.get("ok"):
                raise QueryError(reply.get("error", "query failed"))
            return reply
        try:
            with EventLog(lay.events, read_only=True) as log:
                return {"offline": offline(log)}
        except BuildLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_query(lay: BuildLayout, sql: str) -> tuple[list[str], list[list]]:
    """Run one read-only statement against a build; returns (columns, rows) with JSON-able values."""
    check_read_only(sql)
    reply = _ask_or_read(lay, {"op": "sql", "sql": sql}, lambda log: log.query(sql))
    if "offline" in reply:
        cols, rows = reply["offline"]
        return cols, [[jsonable(v) for v in r] for r in rows]
    return reply["columns"], reply["rows"]


def status_snapshot(lay: BuildLayout) -> dict:
    """Progress plus live state (paused, free space, ...) from the owner, or from the file when idle."""
    reply = _ask_or_read(lay, {"op": "status"}, lambda log: log.progress())
    if "offline" in reply:
        return {"running": False, **{k: jsonable(v) for k, v in reply["offline"].items()}}
    return reply["status"]
