"""The event log: an append-only DuckDB table that is the only truth about each sample's state.

One process owns the log at a time (the coordinator of a run, or a verify sweep). It appends events in
batches, each batch one transaction, as an Arrow table (DuckDB autocommit fsyncs every statement and
`executemany` is slow). Readers either open the file read-only (no owner) or ask the owner over its socket.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import duckdb
import pyarrow as pa

from builder.errors import BuildLockedError, QueryError


def schema_dir() -> Path:
    """`schema/` beside the package in a checkout, or `builder/_schema` in an installed wheel."""
    pkg = Path(__file__).resolve().parent.parent
    for cand in (pkg.parent / "schema", pkg / "_schema"):
        if (cand / "events.sql").is_file():
            return cand
    return Path(str(resources.files("builder") / "_schema"))


class RegisteredSample(Protocol):
    """What the log records of a source sample (extract.source.Sample has these)."""

    sample_id: str
    row: int
    fingerprint: str

    @property
    def num_tokens(self) -> int: ...


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


@dataclass
class Event:
    kind: str
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


ARROW_SCHEMA = pa.schema([
    ("seq", pa.int64()), ("ts", pa.timestamp("us")), ("kind", pa.string()), ("run_id", pa.string()),
    ("sample_id", pa.string()), ("fingerprint", pa.string()), ("attempt", pa.int32()), ("worker", pa.int32()),
    ("segment", pa.string()), ("token_start", pa.int64()), ("num_tokens", pa.int64()), ("nbytes", pa.int64()),
    ("checksums", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
])
COLUMNS = [f.name for f in ARROW_SCHEMA]


def detail(**kw: object) -> str:
    return json.dumps(kw, default=str, sort_keys=True)


class EventLog:
    """Owner's (or read-only) handle on `events.duckdb`."""

    def __init__(self, path: Path, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as e:
            if "lock" in str(e).lower():
                raise BuildLockedError(
                    f"{self.path}: the event log is held by another process (a run or verify is going); "
                    "use `hsbuild status` / `hsbuild sql`, which ask that process, or wait for it to finish"
                ) from e
            raise
        if not read_only:
            self._apply_schema()
        self._seq = self.con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]

    def _apply_schema(self) -> None:
        """Create tables and views; re-create views only when schema/*.sql changed (opening changes nothing)."""
        d = schema_dir()
        ddl = (d / "events.sql").read_text() + (d / "views.sql").read_text()
        digest = hashlib.blake2b(ddl.encode(), digest_size=8).hexdigest()
        try:
            row = self.con.execute("SELECT value FROM meta WHERE key = 'schema_digest'").fetchone()
        except duckdb.CatalogException:
            row = None
        if row and json.loads(row[0]) == digest:
            return
        self.con.execute((d / "events.sql").read_text())
        self.con.execute((d / "views.sql").read_text())
        self.set_meta({"schema_digest": digest})

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------------------------
    def append(self, events: Sequence[Event]) -> None:
        """Commit a batch of events in one transaction."""
        if not events:
            return
        now = utcnow()
        cols: dict[str, list] = {c: [] for c in COLUMNS}
        seq = self._seq
        for ev in events:
            seq += 1
            ev.seq = seq
            if ev.ts is None:
                ev.ts = now
            for c in COLUMNS:
                cols[c].append(getattr(ev, c))
        batch = pa.Table.from_pydict(cols, schema=ARROW_SCHEMA)
        cur = self.con.cursor()
        try:
            cur.register("_batch", batch)
            cur.execute("BEGIN TRANSACTION")
            cur.execute("INSERT INTO events SELECT * FROM _batch")
            cur.execute("COMMIT")
        except BaseException:
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            cur.unregister("_batch")
            cur.close()
        self._seq = seq

    def set_meta(self, items: dict[str, object]) -> None:
        rows = pa.Table.from_pydict({"key": list(items), "value": [json.dumps(v, default=str) for v in items.values()]})
        cur = self.con.cursor()
        cur.register("_meta", rows)
        cur.execute("INSERT OR REPLACE INTO meta SELECT * FROM _meta")
        cur.close()

    def meta(self) -> dict[str, object]:
        return {k: json.loads(v) for k, v in self.con.execute("SELECT key, value FROM meta").fetchall()}

    def register_samples(self, samples: Iterable[RegisteredSample]) -> int:
        """Register source samples not yet known; returns how many were added."""
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
        cur = self.con.cursor()
        try:
            res = cur.execute(sql, list(params))
            cols = [d[0] for d in res.description] if res.description else []
            return cols, res.fetchall() if res.description else []
        except duckdb.Error as e:
            raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from e
        finally:
            cur.close()

    def query_dicts(self, sql: str, params: Sequence[object] = ()) -> list[dict]:
        cols, rows = self.query(sql, params)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def count(self, kind: str) -> int:
        return self.con.execute("SELECT count(*) FROM events WHERE kind = ?", [kind]).fetchone()[0]


FLUSH_SECONDS = 0.5  # an owner commits its pending events at least this often ...
FLUSH_EVENTS = 512  # ... or once this many are pending


class EventBatch:
    """An owner's pending events, committed in batches (one transaction each): when FLUSH_EVENTS are pending,
    FLUSH_SECONDS after the last commit, or when forced. `before_commit` runs first (e.g. release the ballast)."""

    def __init__(self, log: EventLog, run_id: str, before_commit: Callable[[], None] | None = None):
        self.log, self.run_id, self.before_commit = log, run_id, before_commit
        self.events: list[Event] = []
        self.last_commit = time.monotonic()

    def emit(self, ev: Event) -> None:
        ev.run_id = ev.run_id or self.run_id
        self.events.append(ev)

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.events and (force or len(self.events) >= FLUSH_EVENTS or now - self.last_commit >= FLUSH_SECONDS):
            if self.before_commit is not None:
                self.before_commit()
            self.log.append(self.events)
            self.events = []
            self.last_commit = now


def open_log(path: Path, read_only: bool = False, wait: float = 15.0) -> EventLog:
    """Open the log, waiting while another process holds the file for a moment (a short-lived `hsbuild sql`
    reader, or an owner that is just finishing)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return EventLog(path, read_only=read_only)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1 if read_only else 0.2)
