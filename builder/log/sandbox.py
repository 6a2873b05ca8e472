"""Where user SQL (`hsbuild sql`) runs: never on a DuckDB instance that can write the event log.

A statement-type check cannot be the guard (`EXPLAIN ANALYZE DELETE ...` executes its DELETE; a read-only
transaction ends with `COMMIT`), so the guard is structural:

- No owner: the file is opened `read_only=True` in a fresh, locked-down instance (`LOCKDOWN`: no file or
  network access, no extensions loaded or installed, configuration frozen), only for the query.
- An owner: its one read-write instance never runs user SQL. The query runs in a throwaway in-memory
  instance, locked down the same way (and unable to spill to disk), holding Arrow snapshots of `events`
  (cached by the owner and topped up by `seq`), `meta`, `source_samples` and the fold's checkpoint (cached
  until it is replaced), and the views of
  schema/views.sql as TEMP views. One query at a time; the snapshot cache is dropped when unused. Each query
  takes a snapshot begun after it was asked (fresh), unless a log commit holds the log (`LiveReplica`).

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
from builder.log.stall import stall_limit

if TYPE_CHECKING:
    import pyarrow as pa

    from builder.log.stall import Stall

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


def queries_file(path: Path, statements: list[str], timeout: float = QUERY_TIMEOUT_S,
                 interrupt_if: Callable[[], bool] | None = None) -> list[tuple[list[str], list[tuple]]]:
    """Several SELECTs of hsbuild's own (the report's) on the log of a build no process owns: each one's
    (columns, rows), all from one read-only open (one state of the file, one open's cost), locked down and watched
    as `query_file` is (`timeout` each)."""
    con = _open_file(path)
    try:
        return [run_guarded(con, sql, timeout, interrupt_if) for sql in statements]
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
    view (the macros they call, `is_transient` and `checksums_text`) is made every time: the user's SQL may call
    them too."""

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


# A log commit pending this long holds the owner's log (a volume that does not answer, or not yet): a live query
# is then answered from the last snapshot, saying how old it is. Otherwise a query waits for a snapshot taken
# after it was asked, however long the log takes to give it (a big log's first one), within the query's timeout.
SNAPSHOT_WAIT_S = 0.5
SNAPSHOT_POLL_S = 0.02
CHUNKS_MAX = 256  # the cached events' Arrow chunks (one a refresh) are merged beyond this many


class LiveReplica:
    """The owner's side of live user SQL: snapshots of its log, queried in a throwaway locked-down instance.

    Freshness: an answer reflects every event committed before the question reached the owner (its snapshot is
    begun after that), unless a log commit has been pending SNAPSHOT_WAIT_S or more (`commit_pending`: the
    owner's stall watch): then the last snapshot answers, `stale` is set and `as_of` says when it was taken."""

    def __init__(self, log: EventLog, commit_pending: Callable[[], Stall | None] | None = None):
        self.closing = False  # the owner is shutting down: running queries are interrupted
        self.log = log
        self.commit_pending = commit_pending or (lambda: None)
        self._lock = threading.Lock()  # one replica query at a time: bounded memory and CPU
        self._events: pa.Table | None = None
        self._last_seq = 0
        self._source: pa.Table | None = None  # source_samples (rows only ever added: re-read when its count grows)
        self._fold: pa.Table | None = None  # the fold's checkpoint (schema/events.sql), as of mark `_fold_upto`
        self._fold_upto = -1
        self._used = time.monotonic()
        self._views = _TempViews(temp_views_sql())
        self._last: tuple[dict, float | None] = ({}, None)  # the last snapshot taken, and when it was begun
        self._snap_lock = threading.Lock()  # held while a snapshot reads the owner's connection
        self.stale = False  # the last answer came from an older snapshot (a log commit held the log)
        self.as_of: float | None = None  # time.time() when the last answer's snapshot was begun
        self.held_by: Stall | None = None  # the pending commit a stale answer did not wait for

    def _snapshot(self) -> dict[str, pa.Table]:
        """One consistent snapshot of the three tables (owner-written SQL on the owner's connection only);
        events are append-only with a strictly increasing seq, so only the new ones are read."""
        cur = self.log.con.cursor()
        try:
            cur.execute("BEGIN TRANSACTION READ ONLY")
            delta = cur.sql("SELECT * FROM events WHERE seq > ? ORDER BY seq", params=[self._last_seq]).to_arrow_table()
            meta = cur.sql("SELECT * FROM meta").to_arrow_table()
            rows = cur.execute("SELECT count(*) FROM source_samples").fetchall()[0][0]
            if self._source is None or self._source.num_rows != rows:
                self._source = cur.sql("SELECT * FROM source_samples").to_arrow_table()
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
            if self._events["seq"].num_chunks > CHUNKS_MAX:
                self._events = self._events.combine_chunks()
        if delta.num_rows:
            self._last_seq = delta["seq"][-1].as_py()
        return {"events": self._events, "meta": meta, "source_samples": self._source,
                "fold_checkpoint": self._fold, "fold_checkpoint_mark": mark}

    def _held(self, since: float) -> Stall | None:
        """The log commit holding the owner's log: one pending since before `since` (time.monotonic(): what a
        snapshot begun then waits behind; a commit begun later does not hold it) for SNAPSHOT_WAIT_S, or, with no
        snapshot to answer from, for the stall watch's limit (HSBUILD_STALL_S: then it is named a stall)."""
        pending = self.commit_pending()
        if pending is None or pending.since > since:
            return None
        return pending if pending.pending_s() >= (SNAPSHOT_WAIT_S if self._last[0] else stall_limit()) else None

    def _fresh_snapshot(self, deadline: float) -> dict | None:
        """A snapshot begun now (after the question), waited for while the log answers: None when a log commit
        holds the log (`held_by` says which) or `deadline` passes first. A snapshot not waited for finishes in its
        own thread, later (and is the one a later stale answer gives); no second one starts meanwhile (a query
        waits for it, then takes its own)."""
        self.held_by = None
        asked = time.monotonic()
        while not self._snap_lock.acquire(blocking=False):  # the one a stale answer left behind: still running
            if (held := self._held(asked)) is not None or time.monotonic() >= deadline:
                self.held_by = held
                return None
            time.sleep(SNAPSHOT_POLL_S)
        box: dict = {"as_of": time.time()}
        begun = time.monotonic()
        done = threading.Event()

        def work() -> None:
            try:
                tables = box["tables"] = self._snapshot()
                self._last = (tables, box["as_of"])
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            finally:
                self._snap_lock.release()
                done.set()

        threading.Thread(target=work, name="hsbuild-replica-snapshot", daemon=True).start()
        while not done.wait(SNAPSHOT_POLL_S):
            if (held := self._held(begun)) is not None or time.monotonic() >= deadline:
                self.held_by = held
                return None
        if "error" in box:
            raise box["error"]
        return box["tables"]

    def query(self, sql: str, timeout: float = QUERY_TIMEOUT_S, refresh: bool = True) -> tuple[list[str], list[tuple]]:
        """`refresh`: take the events committed since the last snapshot first (waited for while the log answers,
        within `timeout`). Without (the owner's storage is stalled), or when a log commit holds the log, the last
        snapshot answers: `stale` says so and `as_of` when it was taken."""
        with self._lock:
            self._used = time.monotonic()
            deadline = self._used + timeout
            tables = self._fresh_snapshot(deadline) if refresh else None
            self.stale = tables is None
            last, self.as_of = self._last  # (one snapshot and its time: a late snapshot thread may replace it)
            if tables is None and last:
                tables = last
            elif tables is None and (self.held_by is not None or not refresh):
                what = f" ({self.held_by.describe()})" if self.held_by is not None else ""
                raise QueryError(f"the build's log does not answer: a commit to it has not returned{what}: a "
                                 "stalled volume? No snapshot of it was taken before: `hsbuild status` says what "
                                 "the owner knows; ask again once writes return")
            elif tables is None:
                raise QueryInterrupted(f"query stopped after {timeout:g} s: the owner's log took longer to give "
                                       "a snapshot of itself (pass --timeout SECONDS to allow more)", "timeout")
            con = duckdb.connect(":memory:", config={"threads": REPLICA_THREADS, "memory_limit": REPLICA_MEMORY})
            try:
                con.execute("SET temp_directory = ''")  # no spilling; must precede the lockdown
                _lock_down(con)
                for name, table in tables.items():
                    con.register(name, table)
                views = self._views.read_by(sql if isinstance(sql, str) else " ".join(sql))
                if views:
                    con.execute(views)
                left = max(deadline - time.monotonic(), 1.0)
                if not isinstance(sql, str):  # (`arrow`: each statement's table, all from this snapshot)
                    return [run_guarded(con, s, left, interrupt_if=lambda: self.closing, arrow=True) for s in sql]
                return run_guarded(con, sql, left, interrupt_if=lambda: self.closing)
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
                self._events, self._last_seq, self._source = None, 0, None
                self._fold, self._fold_upto = None, -1
                self._last = ({}, None)
            finally:
                self._lock.release()
