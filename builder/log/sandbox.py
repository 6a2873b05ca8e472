"""Where user SQL (`hsbuild sql`) runs: never on a DuckDB instance that can write the event log.

A statement-type check cannot be the guard (`EXPLAIN ANALYZE DELETE ...` executes its DELETE; a read-only
transaction ends with `COMMIT`), so the guard is structural:

- No owner: the file is opened `read_only=True` in a fresh, locked-down instance (`LOCKDOWN`: no file or
  network access, no extensions loaded or installed, configuration frozen), only for the query.
- An owner: its one read-write instance never runs user SQL. The query runs in a throwaway in-memory
  instance, locked down the same way (and unable to spill to disk), holding Arrow snapshots of `events`
  (cached by the owner and topped up by `seq`), `meta`, `source_samples` and the fold's checkpoint (cached
  until it is replaced), and the views of
  schema/views.sql as TEMP views. One query at a time; the snapshot cache is dropped when unused.

Every query runs under a watchdog that interrupts it after a timeout (or when asked, e.g. an owner appeared).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from builder.errors import BuildLockedError, LogDamagedError, QueryError, ReadOnlyQueryError
from builder.log.events import EventLog
from builder.log.schema import read_with_current_views, temp_views_sql

if TYPE_CHECKING:
    import pyarrow as pa

QUERY_TIMEOUT_S = 30.0  # default limit of one `hsbuild sql` query
MAX_TIMEOUT_S = 3600.0
REPLICA_MEMORY = "1GB"  # DuckDB memory limit of the live replica (it cannot spill: temp_directory is off)
REPLICA_THREADS = 2
REPLICA_IDLE_DROP_S = 60.0  # the owner drops its cached snapshot after this long without a query

LOCKDOWN = {  # order matters: lock_configuration last
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}


class QueryInterrupted(QueryError):
    """The watchdog stopped the query (`reason`: 'timeout' or 'asked')."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def sql_error(e: duckdb.Error) -> QueryError:
    """A DuckDB error as one line; writes and disabled features read as refusals."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    low = first.lower()
    if isinstance(e, duckdb.PermissionException) or "read-only" in low or "read only" in low:
        return ReadOnlyQueryError(f"refused: {first}; `hsbuild sql` is read-only")
    return QueryError(f"SQL error: {first}")


def run_guarded(con: duckdb.DuckDBPyConnection, sql: str, timeout: float,
                interrupt_if: Callable[[], bool] | None = None, arrow: bool = False):
    """Run `sql` on `con` and fetch it, interrupting it after `timeout` s or once `interrupt_if()` is true:
    (columns, rows), or with `arrow` an Arrow table."""
    done = threading.Event()
    why: list[str] = []

    def watch() -> None:
        end = time.monotonic() + timeout
        while not done.wait(0.1):
            if time.monotonic() >= end:
                why.append("timeout")
            elif interrupt_if is not None and interrupt_if():
                why.append("asked")
            else:
                continue
            con.interrupt()
            return

    watchdog = threading.Thread(target=watch, name="hsbuild-sql-watchdog", daemon=True)
    watchdog.start()
    try:
        if arrow:
            return con.sql(sql).to_arrow_table()
        res = con.execute(sql)
        if not res.description:
            return [], []
        return [d[0] for d in res.description], res.fetchall()
    except duckdb.Error as e:
        if why == ["timeout"]:
            raise QueryInterrupted(f"query stopped after {timeout:g} s (pass --timeout SECONDS to allow more)",
                                   "timeout") from None
        if why == ["asked"]:
            raise QueryInterrupted("query interrupted", "asked") from None
        raise sql_error(e) from None
    finally:
        done.set()
        watchdog.join()


def _lock_down(con: duckdb.DuckDBPyConnection) -> None:
    for key, value in LOCKDOWN.items():
        con.execute(f"SET {key} = {str(value).lower()}")


def _damaged(path: Path, e: Exception) -> LogDamagedError:
    return LogDamagedError(f"{path}: cannot open the event log ({str(e).splitlines()[0][:160]}); if it is damaged, "
                           f"rebuild it from the data with `hsbuild rebuild-log {Path(path).parent}`")


def _open_file(path: Path) -> duckdb.DuckDBPyConnection:
    """The log file of a build no process owns, opened read-only and locked down, with this version's views.
    Raises BuildLockedError when an owner holds the file."""
    try:
        con = duckdb.connect(str(path), read_only=True, config=dict(LOCKDOWN))
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise BuildLockedError(f"{path}: held by the build's owner") from e
        raise _damaged(path, e) from e
    except duckdb.Error as e:
        raise _damaged(path, e) from e
    try:
        read_with_current_views(con, path)
    except BaseException:
        con.close()
        raise
    return con


def query_file(path: Path, sql: str, timeout: float = QUERY_TIMEOUT_S,
               interrupt_if: Callable[[], bool] | None = None) -> tuple[list[str], list[tuple]]:
    """Run user SQL on the log file of a build no process owns: read-only, locked down, held only for the
    query. Raises BuildLockedError when an owner holds the file."""
    con = _open_file(path)
    try:
        return run_guarded(con, sql, timeout, interrupt_if)
    finally:
        con.close()


def arrow_file(path: Path, statements: list[str], timeout: float = QUERY_TIMEOUT_S,
               interrupt_if: Callable[[], bool] | None = None) -> list[pa.Table]:
    """hsbuild's own columnar reads of the log of a build no process owns (the reader's index): each statement's
    result as an Arrow table, all from one read-only open, so all from one state of the file (no writer can open
    it meanwhile); locked down and watched as `query_file` is (`timeout` each)."""
    con = _open_file(path)
    try:
        return [run_guarded(con, sql, timeout, interrupt_if, arrow=True) for sql in statements]
    finally:
        con.close()


class _TempViews:
    """schema/views.sql's TEMP views, by name: a live query's throwaway instance gets only the views its SQL
    names, with the views those read (creating all of them takes ~25 ms of CPU, more than most queries; a poll
    of `events` needs none). A name is matched anywhere in the SQL, string literals included, so a view is
    never missing where it is read; one created and not read changes no answer. What comes before the first
    view (the macro they call, `is_transient`) is made every time: the user's SQL may call it too."""

    def __init__(self, ddl: str):
        parts = re.split(r"(?=^CREATE\s+OR\s+REPLACE\s+TEMP\s+VIEW\s)", ddl, flags=re.MULTILINE | re.IGNORECASE)
        self._preamble = parts[0]
        self._sql: dict[str, str] = {}
        for part in parts:
            m = re.match(r"CREATE\s+OR\s+REPLACE\s+TEMP\s+VIEW\s+(\w+)", part, flags=re.IGNORECASE)
            if m:
                self._sql[m.group(1).lower()] = part
        if not self._sql:
            raise ValueError("schema/views.sql: no view found in it")
        self._reads = {name: self._named(body) - {name} for name, body in self._sql.items()}

    def _named(self, sql: str) -> set[str]:
        words = {w.lower() for w in re.findall(r"\w+", sql)}
        return words & set(self._sql)

    def read_by(self, sql: str) -> str:
        """The DDL of the views `sql` reads, directly or through other views, in views.sql's order."""
        need: set[str] = set()
        todo = list(self._named(sql))
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo.extend(self._reads[name])
        return self._preamble + "".join(body for name, body in self._sql.items() if name in need)


SNAPSHOT_WAIT_S = 0.5  # a snapshot the owner's log does not give in this long: answered from the last one


class LiveReplica:
    """The owner's side of live user SQL: snapshots of its log, queried in a throwaway locked-down instance."""

    def __init__(self, log: EventLog):
        self.closing = False  # the owner is shutting down: running queries are interrupted
        self.log = log
        self._lock = threading.Lock()  # one replica query at a time: bounded memory and CPU
        self._events: pa.Table | None = None
        self._last_seq = 0
        self._fold: pa.Table | None = None  # the fold's checkpoint (schema/events.sql), as of mark `_fold_upto`
        self._fold_upto = -1
        self._used = time.monotonic()
        self._views = _TempViews(temp_views_sql())
        self._last_tables: dict = {}
        self._snap_lock = threading.Lock()  # held while a snapshot reads the owner's connection
        self.stale = False  # the last answer came from an older snapshot (the log did not answer in time)

    def _snapshot(self) -> dict[str, pa.Table]:
        """One consistent snapshot of the three tables (owner-written SQL on the owner's connection only);
        events are append-only with a strictly increasing seq, so only the new ones are read."""
        cur = self.log.con.cursor()
        try:
            cur.execute("BEGIN TRANSACTION READ ONLY")
            delta = cur.sql("SELECT * FROM events WHERE seq > ? ORDER BY seq", params=[self._last_seq]).to_arrow_table()
            meta = cur.sql("SELECT * FROM meta").to_arrow_table()
            source = cur.sql("SELECT * FROM source_samples").to_arrow_table()
            mark = cur.sql("SELECT * FROM fold_checkpoint_mark").to_arrow_table()
            upto = mark["upto"][0].as_py() if mark.num_rows else 0
            if self._fold is None or self._fold_upto != upto:  # replaced whole, rarely: re-read only then
                self._fold, self._fold_upto = cur.sql("SELECT * FROM fold_checkpoint").to_arrow_table(), upto
            cur.execute("COMMIT")
        finally:
            cur.close()
        if self._events is None:
            self._events = delta
        elif delta.num_rows:
            import pyarrow as pa  # noqa: PLC0415 (only an owner's replica needs it)

            self._events = pa.concat_tables([self._events, delta])
        if delta.num_rows:
            self._last_seq = delta["seq"][-1].as_py()
        return {"events": self._events, "meta": meta, "source_samples": source, "fold_checkpoint": self._fold,
                "fold_checkpoint_mark": mark}

    def _snapshot_within(self, wait: float) -> dict | None:
        """A fresh snapshot, or None when it does not come within `wait` seconds (the owner's connection is stuck
        in a commit on a stalled volume): that one finishes in its own thread, later, and no second is started
        meanwhile."""
        if not self._snap_lock.acquire(blocking=False):  # a snapshot is still stuck
            return None
        box: dict = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["tables"] = self._snapshot()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                self._snap_lock.release()
                done.set()

        threading.Thread(target=work, name="hsbuild-replica-snapshot", daemon=True).start()
        if not done.wait(wait):
            return None
        if "error" in box:
            raise box["error"]
        return box["tables"]

    def query(self, sql: str, timeout: float = QUERY_TIMEOUT_S, refresh: bool = True) -> tuple[list[str], list[tuple]]:
        """`refresh`: take the events committed since the last snapshot first (waited for at most
        SNAPSHOT_WAIT_S). Without (the owner's storage is stalled), or when the log does not answer in time (a
        commit that does not return), the last snapshot answers, and `stale` says so."""
        with self._lock:
            self._used = time.monotonic()
            tables = self._snapshot_within(SNAPSHOT_WAIT_S) if refresh else None
            self.stale = tables is None
            if tables is not None:
                self._last_tables = tables
            elif self._last_tables:
                tables = self._last_tables
            else:
                raise QueryError("the build's log does not answer (a commit on its volume has not returned: a "
                                 "stalled volume?) and no snapshot of it was taken before: `hsbuild status` says "
                                 "what the owner knows; ask again once writes return")
            con = duckdb.connect(":memory:", config={"threads": REPLICA_THREADS, "memory_limit": REPLICA_MEMORY})
            try:
                con.execute("SET temp_directory = ''")  # no spilling; must precede the lockdown
                _lock_down(con)
                for name, table in tables.items():
                    con.register(name, table)
                views = self._views.read_by(sql if isinstance(sql, str) else " ".join(sql))
                if views:
                    con.execute(views)
                if not isinstance(sql, str):  # (`arrow`: each statement's table, all from this snapshot)
                    return [run_guarded(con, s, timeout, interrupt_if=lambda: self.closing, arrow=True) for s in sql]
                return run_guarded(con, sql, timeout, interrupt_if=lambda: self.closing)
            finally:
                con.close()
                self._used = time.monotonic()

    def arrow(self, statements: list[str], timeout: float = QUERY_TIMEOUT_S, refresh: bool = True) -> list[pa.Table]:
        """hsbuild's own bulk reads (the reader's index, builder/log/bulk.py): each statement's result as an Arrow
        table, all from one snapshot (`timeout` each; `refresh` as in `query`). The tables are Arrow memory of
        this process: only the queries' own work counts against REPLICA_MEMORY."""
        return self.query(statements, timeout, refresh)  # type: ignore[arg-type, return-value]

    def drop_if_idle(self, idle: float = REPLICA_IDLE_DROP_S) -> None:
        """Free the cached snapshot when no query came for `idle` seconds."""
        if self._events is not None and time.monotonic() - self._used > idle and self._lock.acquire(blocking=False):
            try:
                self._events, self._last_seq = None, 0
                self._fold, self._fold_upto = None, -1
                self._last_tables = {}
            finally:
                self._lock.release()
