"""hsbuild's own bulk reads of a live owner's log (the reader's index): Arrow tables over the owner's socket.

A `sql` reply is one JSON line, fine for what `hsbuild sql` shows, not for a million rows. The `arrow` op takes
a list of SELECT statements, runs them on one snapshot of the owner's replica (`LiveReplica.arrow`: the rows of
each are Arrow memory of the owner, only the query's own work counts against the replica's memory), and answers
with one JSON line (`{"ok": true, "tables": N}`, or the usual error reply) followed by N frames, one a table:
its length (8 bytes, little-endian) and the table as an Arrow IPC stream.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import QueryError
from builder.log.query import check_read_only, check_timeout, send_request
from builder.log.sandbox import QUERY_TIMEOUT_S

if TYPE_CHECKING:
    import pyarrow as pa

    from builder.log.sandbox import LiveReplica

TABLES = "_tables"  # the reply's key for the tables to send after its line (never sent as JSON)


def answer(replica: LiveReplica | None, req: dict, refresh: bool) -> dict:
    """The owner's reply to an `arrow` request: the tables under TABLES (QueryServer sends them after the
    line). `refresh`: take the events committed since the last snapshot (False while the owner's log stalls)."""
    statements = req.get("statements")
    if not isinstance(statements, list) or not statements or not all(isinstance(s, str) for s in statements):
        raise QueryError("arrow: give `statements`, a list of SELECT statements")
    for sql in statements:
        check_read_only(sql)
    timeout = check_timeout(float(req.get("timeout") or QUERY_TIMEOUT_S))
    if replica is None:
        return {"ok": False, "starting": True, "error": "the process that owns this build is starting and has no "
                "log open yet"}
    tables = replica.arrow(statements, timeout, refresh=refresh)
    return {"ok": True, "tables": len(tables), TABLES: tables}


def send_tables(conn: socket.socket, tables: list[pa.Table]) -> None:
    """The frames after the reply line: each table's length, then the table as an Arrow IPC stream."""
    import pyarrow as pa  # noqa: PLC0415

    for t in tables:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
        buf = sink.getvalue()
        conn.sendall(buf.size.to_bytes(8, "little"))
        conn.sendall(memoryview(buf))
        del buf


def ask_owner_arrow(sock_path: Path, request: dict, timeout: float = 2.0) -> dict:
    """`ask_owner` for an `arrow` request: the reply, with `tables` the Arrow tables when it is ok."""
    import pyarrow as pa  # noqa: PLC0415

    s = send_request(sock_path, request, timeout)
    try:
        with s.makefile("rb") as f:
            line = f.readline()
            if not line.endswith(b"\n"):
                raise ConnectionResetError("the owner closed the connection without answering")
            reply = json.loads(line)
            if not reply.get("ok"):
                return reply
            tables = []
            for _ in range(int(reply["tables"])):
                size = int.from_bytes(_exactly(f, 8), "little")
                tables.append(pa.ipc.open_stream(pa.py_buffer(_exactly(f, size))).read_all())
            reply["tables"] = tables
            return reply
    finally:
        s.close()


def _exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ConnectionResetError(f"the owner's answer ended after {len(data)} of {n} bytes")
    return data
