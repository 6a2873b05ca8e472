"""The owner's query server: answers `hsbuild status` / `hsbuild sql` from other shells during a run.

A daemon thread accepts connections on a Unix socket (mode 0600). Each request is one JSON line; each reply
one JSON line. `status` runs the owner's own queries on a cursor of its connection. User SQL never touches
that connection: it runs on a snapshot in a throwaway, locked-down instance (`sandbox.LiveReplica`), begun after
the question came, so it sees every event committed before it (the owner commits at least every 0.5 s), and can
neither write nor block the writer. Only while a log commit has been pending 0.5 s or more (a volume that does not
answer) does an older snapshot answer, and the reply says so and how old it is (`as_of`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import HsbuildError
from builder.log import bulk
from builder.log.events import EventLog
from builder.log.query import check_read_only, check_timeout, jsonable, recv_line
from builder.log.sandbox import QUERY_TIMEOUT_S, LiveReplica, QueryInterrupted

if TYPE_CHECKING:
    from builder.log.stall import Stall


class QueryServer:
    def __init__(self, sock_path: Path, log: EventLog | None, status_fn: Callable[[], dict],
                 stalled: Callable[[], dict | None] | None = None,
                 commit_pending: Callable[[], Stall | None] | None = None):
        """`log`: None while the owner starts (sql is asked to wait, `attach` it once open); `stalled`: what
        the owner's stall watch says (sql then answers from the last snapshot, naming the stall);
        `commit_pending`: the owner's oldest log commit still pending (a query waits for a fresh snapshot
        unless one has been pending 0.5 s: `sandbox.LiveReplica`)."""
        self.sock_path, self.log, self.status_fn = Path(sock_path), log, status_fn
        self.stalled = stalled or (lambda: None)
        self.commit_pending = commit_pending
        self.replica = LiveReplica(log, commit_pending) if log is not None else None
        self.error: str | None = None  # why the socket could not be opened (the owner runs on without it)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handlers: list[threading.Thread] = []
        self._sock: socket.socket | None = None

    def start(self) -> QueryServer:
        """Listen; on failure (e.g. no room for the socket's inode) the owner goes on without answering
        queries, and `error` says why."""
        try:
            self.sock_path.unlink(missing_ok=True)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                s.bind(str(self.sock_path))
            finally:
                os.umask(old)
            os.chmod(self.sock_path, 0o600)
            s.listen(16)
            s.settimeout(0.2)
        except OSError as e:
            self.error = f"{self.sock_path}: {e.strerror or e}"
            return self
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="hsbuild-query", daemon=True)
        self._thread.start()
        return self

    def attach(self, log: EventLog) -> None:
        """The owner opened its log: sql is answered from now on."""
        self.log = log
        self.replica = LiveReplica(log, self.commit_pending)

    def stop(self) -> None:
        """Stop accepting, interrupt the queries running, and wait for their threads: none may still be inside
        DuckDB when the owner closes the log or the process exits (that aborts the process)."""
        self._stop.set()
        if self.replica is not None:
            self.replica.closing = True
        if self._thread:
            self._thread.join(timeout=2)
        deadline = time.monotonic() + 10
        for t in list(self._handlers):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._sock:
            self._sock.close()
        if self._sock:
            self.sock_path.unlink(missing_ok=True)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            if self.replica is not None:
                self.replica.drop_if_idle()
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._handlers = [h for h in self._handlers if h.is_alive()] + [t]
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(QUERY_TIMEOUT_S + 5)
        try:
            reply = self.answer(json.loads(recv_line(conn)))
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        tables = reply.pop(bulk.TABLES, None)
        try:
            conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
            if tables is not None:  # (an `arrow` answer: its tables follow the line)
                bulk.send_tables(conn, tables)
        except OSError:
            pass
        finally:
            conn.close()

    def answer(self, req: dict) -> dict:
        op = req.get("op")
        try:
            if op == "sql":
                check_read_only(req.get("sql", ""))
                timeout = check_timeout(float(req.get("timeout") or QUERY_TIMEOUT_S))
                if self.replica is None:
                    st = self.status_fn()
                    return {"ok": False, "starting": True, "error": f"the {st.get('purpose', 'process')} that "
                            f"owns this build (pid {st.get('pid')}) is starting ({st.get('phase', 'starting')}) and "
                            "has no log open yet"}
                stall = self.stalled()
                try:
                    cols, rows = self.replica.query(req["sql"], timeout, refresh=stall is None)
                except QueryInterrupted as e:
                    if e.reason == "asked" and self.replica.closing:  # the owner ends: ask again, of the file
                        return {"ok": False, "closing": True, "error": "the owner is closing the log"}
                    raise
                if stall is None and self.replica.stale:  # (not yet named a stall: a commit pending, or slow)
                    held = self.replica.held_by
                    stall = {**(held.as_dict() if held is not None else
                                {"what": "snapshot", "path": str(self.log.path) if self.log else "?",
                                 "filesystem": "?", "pending_s": 0.0, "since": None}),
                             "early": True, "held": held is not None}
                return {"ok": True, "columns": cols, "rows": [[jsonable(v) for v in r] for r in rows],
                        "as_of": self.replica.as_of, **({"stalled": stall} if stall is not None else {})}
            if op == "arrow":  # hsbuild's own bulk read (the reader's index): builder/log/bulk.py
                return bulk.answer(self.replica, req, refresh=self.stalled() is None)
            if op == "status":  # (while the owner starts: its phase, and the client may wait a moment)
                return {"ok": True, "status": jsonable(self.status_fn()),
                        **({"starting": True} if self.replica is None else {})}
            return {"ok": False, "error": f"unknown op {op!r}"}
        except HsbuildError as e:
            return {"ok": False, "error": str(e), "kind": type(e).__name__}
