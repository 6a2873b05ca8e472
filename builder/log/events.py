"""The event log: an append-only DuckDB table that is the only truth about each sample's state.

One process owns the log at a time (the coordinator of a run, or a verify sweep). It appends events in
batches, each batch one transaction, as an Arrow table (DuckDB autocommit fsyncs every statement and
`executemany` is slow). Readers either open the file read-only (no owner) or ask the owner over its socket.

`seq` is unique (an index) and each append checks that the log's last `seq` is still the one this owner
wrote: a second writer (which the build lock should make impossible) fails loudly instead of interleaving.
A full disk surfaces as `DiskFullError`; `EventBatch` keeps its events and retries (see its docstring).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import duckdb

if TYPE_CHECKING:
    import pyarrow as pa

from builder.errors import (
    BuildLockedError,
    DiskFullError,
    LogConflictError,
    LogDamagedError,
    QueryError,
    is_no_space,
)
from builder.fsutil import fsync_path
from builder.log.checksums import check as check_checksums
from builder.log.checksums import compact
from builder.log.holders import locked_error
from builder.log.kinds import EventKind
from builder.log.schema import read_with_current_views, schema_digest, schema_dir, views_failed, views_sql


class RegisteredSample(Protocol):
    """What the log records of a source sample (extract.source.Sample has these)."""

    sample_id: str
    row: int
    fingerprint: str

    @property
    def num_tokens(self) -> int: ...


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


KINDS = frozenset(EventKind)


@dataclass
class Event:
    kind: str  # an EventKind (a member, or its string)
    run_id: str | None = None
    sample_id: str | None = None
    fingerprint: str | None = None
    attempt: int | None = None
    worker: int | None = None
    segment: str | None = None
    token_start: int | None = None
    num_tokens: int | None = None
    nbytes: int | None = None
    checksums: str | None = None
    reason: str | None = None
    detail: str | None = None
    ts: dt.datetime | None = None
    seq: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:  # the code's mistake: said where the event is made, before anything is written
            raise ValueError(f"event kind {self.kind!r} is not one of builder.log.kinds.EventKind")
        check_checksums(self.checksums)  # checksums the log would read back as another text: refused here too


COLUMNS = ["seq", "ts", "kind", "run_id", "sample_id", "fingerprint", "attempt", "worker", "segment", "token_start",
           "num_tokens", "nbytes", "checksums", "reason", "detail"]


@functools.cache
def arrow_schema() -> pa.Schema:
    """The events table as Arrow (pyarrow is imported only by what writes: `status` and `sql` start faster)."""
    import pyarrow as pa  # noqa: PLC0415

    types = {"seq": pa.int64(), "ts": pa.timestamp("us"), "attempt": pa.int32(), "worker": pa.int32(),
             "token_start": pa.int64(), "num_tokens": pa.int64(), "nbytes": pa.int64()}
    return pa.schema([(c, types.get(c, pa.string())) for c in COLUMNS])


def detail(**kw: object) -> str:
    return json.dumps(kw, default=str, sort_keys=True)


CHECKPOINT_BYTES = 4 << 20  # DuckDB folds its WAL into the database file once the WAL holds this much
# An owner checkpoints the fold (`fold_checkpoint`, schema/events.sql) once this many events came after the last
# one: reading states then folds at most about this many events besides the checkpoint's one row per sample.
FOLD_CHECKPOINT_EVENTS = 100_000


class EventLog:
    """Owner's (or read-only) handle on `events.duckdb`."""

    def __init__(self, path: Path, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as e:
            if "lock" in str(e).lower():
                raise locked_error(self.path, self.read_only, str(e)) from e
            if is_no_space(e):
                raise DiskFullError(f"{self.path}: cannot open the event log: the volume is full; free space "
                                    "and try again") from e
            raise LogDamagedError(
                f"{self.path}: the event log is damaged or unreadable ({str(e).splitlines()[0][:160]}); rebuild it "
                f"from the data with `hsbuild rebuild-log {self.path.parent}` (the damaged file is kept, renamed)"
            ) from e
        except duckdb.Error as e:  # not a database, truncated, a WAL that does not match: the log is damaged
            raise LogDamagedError(
                f"{self.path}: the event log is damaged ({str(e).splitlines()[0][:160]}); rebuild it from the "
                f"data with `hsbuild rebuild-log {self.path.parent}` (the damaged file is kept, renamed)") from e
        try:
            if not read_only:
                self._sync_dir()  # the log file may be new: its directory entry must be durable too
                # checkpoint as the log grows: the WAL (what a lost WAL file would take with it) stays small
                self.con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_BYTES}B'")
                self._apply_schema()
            else:
                read_with_current_views(self.con, self.path)
            self._seq = self.con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
            self._fold_upto = self._read_fold_upto()
        except duckdb.Error as e:
            self.con.close()
            if isinstance(e, duckdb.IOException | duckdb.CatalogException | duckdb.SerializationException
                          | duckdb.InternalException):
                raise LogDamagedError(
                    f"{self.path}: the event log is damaged ({str(e).splitlines()[0][:160]}); rebuild it from the "
                    f"data with `hsbuild rebuild-log {self.path.parent}`") from e
            raise
        except BaseException:
            self.con.close()
            raise

    def _sync_dir(self) -> None:
        """DuckDB never fsyncs a directory, yet creates `events.duckdb.wal` at the first commit after each
        checkpoint and unlinks it at every checkpoint (explicit, automatic, on close). Under POSIX's worst case a
        commit is durable only once those directory entries are: a WAL that vanishes loses acknowledged
        commits; one that comes back two checkpoints stale makes the log unopenable. So the owner fsyncs the
        log's directory after opening, after every commit and after closing (one directory fsync a batch)."""
        if not self.read_only:
            fsync_path(self.path.parent)

    def _apply_schema(self) -> None:
        """Create tables and views; re-create views only when schema/*.sql changed (opening changes nothing).
        This is also the migration of an existing log (e.g. the unique index on `seq`)."""
        d = schema_dir()
        digest = schema_digest()
        try:
            row = self.con.execute("SELECT value FROM meta WHERE key = 'schema_digest'").fetchone()
        except duckdb.CatalogException:
            row = None
        if row and json.loads(row[0]) == digest:
            return
        try:
            # the fold's checkpoint is derived (emptying it changes no answer): made anew in the new layout
            self.con.execute("DROP TABLE IF EXISTS fold_checkpoint; DROP TABLE IF EXISTS fold_checkpoint_mark")
            self.con.execute((d / "events.sql").read_text())
            self.con.execute(views_sql())
            self.set_meta({"schema_digest": digest})
        except duckdb.ConstraintException as e:
            raise LogConflictError(
                f"{self.path}: two events share a seq number (two processes wrote to this log at once, e.g. on a "
                "network filesystem whose locks are local to each host); the log cannot be upgraded. "
                "Inspect it with: hsbuild sql BUILD \"SELECT seq, count(*) FROM events GROUP BY seq HAVING "
                "count(*) > 1\"") from e
        except duckdb.Error as e:
            if is_no_space(e):
                raise DiskFullError(f"{self.path}: cannot update the event log's schema: the volume is full; "
                                    "free space and try again") from e
            raise views_failed(self.path, e) from e

    def _read_fold_upto(self) -> int:
        try:
            return int(self.con.execute("SELECT coalesce(max(upto), 0) FROM fold_checkpoint_mark").fetchone()[0])
        except duckdb.CatalogException:  # a log from before fold checkpoints, opened read-only
            return 0

    @property
    def last_seq(self) -> int:
        """The seq of the log's last event, as this process last read or appended it."""
        return self._seq

    def fold_tail(self) -> int:
        """Events after the fold's checkpoint (what reading a state folds besides it)."""
        return self._seq - self._fold_upto

    def checkpoint_fold(self) -> int:
        """Checkpoint the fold at the last event: `sample_fold` (checkpoint + tail) becomes the checkpoint, in one
        transaction with its mark. Changes no answer of any view, only how many events they fold. Returns the
        seq it folds up to."""
        cur = self.con.cursor()
        try:
            cur.execute("BEGIN TRANSACTION")
            upto = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
            cur.execute("CREATE OR REPLACE TEMP TABLE _fold_next AS SELECT * FROM sample_fold")
            # dropped and made anew, not emptied: DuckDB reuses a dropped table's blocks, not deleted rows' (a
            # DELETE + INSERT grew a 1M-sample log by the checkpoint's size, 84 MiB, at every checkpoint)
            cur.execute("CREATE TEMP TABLE _fold_columns AS SELECT * FROM fold_checkpoint LIMIT 0")
            cur.execute("DROP TABLE fold_checkpoint")
            cur.execute("CREATE TABLE fold_checkpoint AS SELECT * FROM _fold_columns")
            cur.execute("INSERT INTO fold_checkpoint BY NAME SELECT * FROM _fold_next ORDER BY mseq")  # compresses
            cur.execute("DROP TABLE _fold_columns")
            cur.execute("DELETE FROM fold_checkpoint_mark")
            cur.execute("INSERT INTO fold_checkpoint_mark VALUES (?)", [upto])
            cur.execute("DROP TABLE _fold_next")
            cur.execute("COMMIT")
        except BaseException:
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            cur.close()
        self._fold_upto = upto
        self._sync_dir()
        return upto

    def maybe_checkpoint_fold(self, every: int | None = None) -> bool:
        """Checkpoint the fold when `every` (default FOLD_CHECKPOINT_EVENTS) events came after the last
        checkpoint. A checkpoint is a cache: one that cannot be written (a full disk) is skipped, never an
        error."""
        if self.read_only or self.fold_tail() < (FOLD_CHECKPOINT_EVENTS if every is None else every):
            return False
        try:
            self.checkpoint_fold()
        except duckdb.Error:
            return False
        return True

    def close(self) -> None:
        if not self.read_only:
            self.maybe_checkpoint_fold()
        try:
            self.con.close()
        except duckdb.Error as e:  # a checkpoint on a full disk: the committed events stay in the WAL
            if not is_no_space(e):
                raise
        try:
            self._sync_dir()
        except OSError:
            pass

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------------------------
    def append(self, events: Sequence[Event]) -> None:
        """Commit a batch of events in one transaction. Raises DiskFullError when the volume is full (nothing
        of the batch is committed; it may be appended again), LogConflictError when another process appended
        to the log since this one last did."""
        import pyarrow as pa  # noqa: PLC0415
        if not events:
            return
        cols: dict[str, list] = {c: [getattr(ev, c) for ev in events] for c in COLUMNS if c not in ("seq", "ts")}
        cols["checksums"] = [compact(c) for c in cols["checksums"]]  # stored compact; the views give the text
        seqs = list(range(self._seq + 1, self._seq + 1 + len(events)))
        cur = self.con.cursor()
        registered = False
        try:
            cur.execute("BEGIN TRANSACTION")
            top = cur.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]
            if top != self._seq:
                raise self._conflict(top)
            # `ts`: this transaction's time, taken at this attempt (a batch retried after a full disk gets the time
            # of the commit that made it durable, not of its first try); an event given its own `ts` keeps it
            now = utcnow()
            stamps = [ev.ts if ev.ts is not None else now for ev in events]
            batch = pa.Table.from_pydict({"seq": seqs, "ts": stamps, **cols}, schema=arrow_schema())
            cur.register("_batch", batch)
            registered = True
            cur.execute("INSERT INTO events SELECT * FROM _batch")
            cur.execute("COMMIT")
        except BaseException as e:
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if isinstance(e, duckdb.ConstraintException):
                raise self._conflict(None) from e
            if isinstance(e, duckdb.Error) and is_no_space(e):
                raise DiskFullError(f"{self.path}: cannot commit to the event log: the volume is full") from e
            raise
        finally:
            if registered:
                cur.unregister("_batch")
            cur.close()
        for ev, seq, ts in zip(events, seqs, stamps, strict=True):
            ev.seq, ev.ts = seq, ts
        self._sync_dir()
        self._seq = seqs[-1]

    def _conflict(self, top: int | None) -> LogConflictError:
        seen = f"its last seq is {top}, this owner's {self._seq}" if top is not None else "a seq number is taken"
        return LogConflictError(
            f"{self.path}: another process appended to the event log ({seen}): two writers on one build, which "
            "the build lock should prevent (a network filesystem whose locks are local to each host?). This one "
            "stops; what it committed is kept. See `hsbuild doctor` (storage.locking) and docs/design.md")

    def set_meta(self, items: dict[str, object]) -> None:
        import pyarrow as pa  # noqa: PLC0415
        rows = pa.Table.from_pydict({"key": list(items), "value": [json.dumps(v, default=str) for v in items.values()]})
        cur = self.con.cursor()
        cur.register("_meta", rows)
        cur.execute("INSERT OR REPLACE INTO meta SELECT * FROM _meta")
        cur.close()
        self._sync_dir()

    def meta(self) -> dict[str, object]:
        return {k: json.loads(v) for k, v in self.con.execute("SELECT key, value FROM meta").fetchall()}

    def register_samples(self, samples: Iterable[RegisteredSample]) -> int:
        """Register source samples not yet known; returns how many were added."""
        import pyarrow as pa  # noqa: PLC0415
        columns = getattr(samples, "registry_columns", None)
        if columns is not None:  # a source's columnar samples (extract.samples.SourceSamples): no object a row
            tbl = pa.Table.from_pydict(columns())
            if tbl.num_rows == 0:
                return 0
        else:
            samples = list(samples)
            if not samples:
                return 0
            tbl = pa.Table.from_pydict({
                "sample_id": [s.sample_id for s in samples], "row_idx": [s.row for s in samples],
                "fingerprint": [s.fingerprint for s in samples], "num_tokens": [s.num_tokens for s in samples],
            })
        cur = self.con.cursor()
        cur.register("_src", tbl)
        before = cur.execute("SELECT count(*) FROM source_samples").fetchone()[0]
        cur.execute("INSERT INTO source_samples SELECT * FROM _src "
                    "WHERE sample_id NOT IN (SELECT sample_id FROM source_samples)")
        after = cur.execute("SELECT count(*) FROM source_samples").fetchone()[0]
        cur.close()
        self._sync_dir()
        return after - before

    # -- reading ------------------------------------------------------------------------------------------
    def registered(self) -> dict[str, tuple[int, str, int]]:
        rows = self.con.execute("SELECT sample_id, row_idx, fingerprint, num_tokens FROM source_samples").fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def samples(self, where: str = "", params: Sequence[object] = ()) -> list[dict]:
        return self.query_dicts(f"SELECT * FROM samples {where}", params)

    def progress(self) -> dict:
        return self.query_dicts("SELECT * FROM progress")[0]

    def query(self, sql: str, params: Sequence[object] = ()) -> tuple[list[str], list[tuple]]:
        # read-only: on the connection itself, where an older log's TEMP views live (a cursor would not see them)
        cur = self.con if self.read_only else self.con.cursor()
        try:
            res = cur.execute(sql, list(params))
            cols = [d[0] for d in res.description] if res.description else []
            return cols, res.fetchall() if res.description else []
        except duckdb.Error as e:
            raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from e
        finally:
            if cur is not self.con:
                cur.close()

    def query_dicts(self, sql: str, params: Sequence[object] = ()) -> list[dict]:
        cols, rows = self.query(sql, params)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def count(self, kind: str) -> int:
        return self.con.execute("SELECT count(*) FROM events WHERE kind = ?", [kind]).fetchone()[0]


FLUSH_SECONDS = 0.5  # an owner commits its pending events at least this often ...
FLUSH_EVENTS = 512  # ... or once this many are pending
COMMIT_WAIT_S = float(os.environ.get("HSBUILD_COMMIT_WAIT", "120"))  # how long a full disk may stall commits


class EventBatch:
    """An owner's pending events, committed in batches (one transaction each): when FLUSH_EVENTS are pending,
    FLUSH_SECONDS after the last commit, or when forced. `before_commit` runs first (e.g. release the ballast).

    A full disk (DiskFullError) never loses the batch: the events stay pending, `before_commit` runs again
    (releasing the ballast), and commits are retried with backoff (0.1 s doubling to 5 s). A routine flush
    returns at once while stalled; a forced flush waits. Once commits have failed for `wait` seconds
    (COMMIT_WAIT_S, env HSBUILD_COMMIT_WAIT) the flush raises DiskFullError, once: the owner stops at a safe
    point; later flushes still try, quietly, so its last events commit if space comes back meanwhile.
    An owner whose very first commit fails (a run or sweep starting on a full disk) is refused at once.
    """

    def __init__(self, log: EventLog, run_id: str, before_commit: Callable[[], None] | None = None,
                 wait: float | None = None):
        self.log, self.run_id, self.before_commit = log, run_id, before_commit
        self.wait = COMMIT_WAIT_S if wait is None else wait
        self.events: list[Event] = []
        self.max_events = FLUSH_EVENTS  # (an owner whose events come fast, a sweep, commits more at a time)
        self.last_commit = time.monotonic()
        self.stalled_since: float | None = None  # commits fail for lack of space since then
        self.gave_up = False  # DiskFullError was raised once
        self.last_error: DiskFullError | None = None
        self._backoff = 0.0
        self._next_try = 0.0
        self.commits = 0

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def emit(self, ev: Event) -> None:
        ev.run_id = ev.run_id or self.run_id
        self.events.append(ev)

    def due(self, force: bool = False) -> bool:
        """Whether `flush(force)` would try a commit now (events pending, and forced, FLUSH_EVENTS of them, or
        FLUSH_SECONDS since the last commit): a caller that flushes often asks this first, cheaply."""
        return bool(self.events) and (force or len(self.events) >= self.max_events
                                      or time.monotonic() - self.last_commit >= FLUSH_SECONDS)

    def flush(self, force: bool = False) -> bool:
        """Commit the pending events if due. Returns True when none are left pending."""
        now = time.monotonic()
        if not self.events:
            return True
        if not self.due(force):
            return False
        if (force or self.stalled_since is None or now >= self._next_try) and self._try():
            return True
        if self.gave_up:
            return False  # the error has gone up once; keep trying quietly
        if not self.commits:
            self.gave_up = True
            raise DiskFullError(f"{self.log.path}: the volume is full: the event log cannot commit, so nothing can "
                                "start; free space (`hsbuild gc` removes orphaned bytes), then try again"
                                ) from self.last_error
        if force:
            while time.monotonic() - (self.stalled_since or now) < self.wait:
                time.sleep(max(0.0, min(self._next_try - time.monotonic(), 5.0)))
                if self._try():
                    return True
        if time.monotonic() - (self.stalled_since or now) >= self.wait:
            self.gave_up = True
            raise DiskFullError(
                f"{self.log.path}: the event log could not commit for {self.wait:.0f} s: the volume is full "
                f"({len(self.events)} event(s) not committed: their samples are redone); free space, then "
                "`hsbuild resume`") from self.last_error
        return False

    def _try(self) -> bool:
        if self.before_commit is not None:
            self.before_commit()
        try:
            self.log.append(self.events)
        except DiskFullError as e:
            now = time.monotonic()
            if self.stalled_since is None:
                self.stalled_since, self._backoff = now, 0.1
            else:
                self._backoff = min(self._backoff * 2, 5.0)
            self._next_try = now + self._backoff
            self.last_error = e
            return False
        self.events = []
        self.last_commit = time.monotonic()
        self.commits += 1
        self.stalled_since, self.gave_up, self.last_error = None, False, None
        return True


def open_log(path: Path, read_only: bool = False, wait: float = 15.0) -> EventLog:
    """Open the log, waiting while another process holds the file for a moment (a short-lived `hsbuild sql`
    reader, or an owner that is just finishing). Errors other than a held file are not retried."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return EventLog(path, read_only=read_only)
        except BuildLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1 if read_only else 0.2)
