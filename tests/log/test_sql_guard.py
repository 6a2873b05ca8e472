"""`hsbuild sql` cannot change a build, whatever the statement: the guard is structural (a read-only, locked-down
DuckDB instance with no owner; a throwaway in-memory replica during a run), not the statement-type check.

Each attack is tried through the CLI (allowlist in place, as users meet it) and again with the allowlist
switched off (the structural guard alone), on an idle build and during a live run; afterwards the log holds
exactly the events it held (no row deleted or changed, no seq gap), the file is byte-identical when idle, and
no file appeared anywhere the statements point at.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import forked
import pytest

import builder.log.query as query_mod
import builder.log.server as server_mod
from builder.cli.app import main
from builder.errors import QueryError, ReadOnlyQueryError
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.log.query import run_query
from builder.log.server import QueryServer


def attacks(db: Path, out: Path) -> list[str]:
    return [
        "EXPLAIN ANALYZE DELETE FROM events WHERE kind = 'written'",
        "EXPLAIN ANALYZE DELETE FROM events",
        "EXPLAIN ANALYZE INSERT INTO events SELECT * FROM events LIMIT 1",
        "EXPLAIN ANALYZE UPDATE events SET kind = 'x'",
        "EXPLAIN ANALYZE DROP TABLE events",
        "EXPLAIN ANALYZE CREATE TABLE zz AS SELECT 1",
        "DELETE FROM events",
        "PRAGMA force_checkpoint",
        "PRAGMA enable_profiling",
        "SET enable_external_access = true",
        f"SET profiling_output = '{out}/prof.json'",
        f"CALL enable_logging(storage = 'file', storage_path = '{out}/logs')",
        "CHECKPOINT",
        "FORCE CHECKPOINT",
        f"COPY events TO '{out}/x.csv'",
        f"COPY (SELECT * FROM events) TO '{out}/y.parquet'",
        f"EXPORT DATABASE '{out}/exp'",
        f"ATTACH '{out}/new.duckdb' AS n",
        f"ATTACH '{db}' AS rw2 (READ_WRITE)",
        "INSTALL httpfs",
        "LOAD httpfs",
        "CREATE TEMP TABLE t AS SELECT 1 AS a",
        "CREATE MACRO mm(x) AS x + 1",
        "CREATE OR REPLACE VIEW samples AS SELECT 1",
        "SELECT content FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/passwd', sep = ':')",
        "SELECT count(*) FROM glob('/etc/*')",
        f"SELECT * FROM '{out}/none.parquet'",
        "SELECT 1; DELETE FROM events",
        f"ATTACH '{db}' AS rw3; DELETE FROM rw3.events",
        "PREPARE p AS DELETE FROM events; EXECUTE p",
        "COMMIT; DELETE FROM events",
    ]


def cli_refuses(build: Path, sql: str, capsys) -> None:
    """Through the CLI: exit 2, one line on stderr, no traceback."""
    code = main(["sql", str(build), sql])
    err = capsys.readouterr().err.strip()
    assert code == 2, (sql, code, err)
    assert len(err.splitlines()) == 1 and err.startswith("hsbuild sql: error: ") and "Traceback" not in err, err


def try_raw(fn, sql: str) -> None:
    """With the allowlist off: a one-line QueryError (or a harmless result), never anything else."""
    try:
        fn(sql)
    except (QueryError, ReadOnlyQueryError) as e:
        assert "\n" not in str(e), str(e)


@pytest.fixture
def no_allowlist(monkeypatch):
    monkeypatch.setattr(query_mod, "check_read_only", lambda sql: None)
    monkeypatch.setattr(server_mod, "check_read_only", lambda sql: None)


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def log_rows(lay) -> list[tuple]:
    with EventLog(lay.events, read_only=True) as log:
        return log.query("SELECT seq, kind, sample_id, run_id, detail FROM events ORDER BY seq")[1]


def test_idle_build_cannot_be_changed_by_any_statement(make_build, tmp_path, capsys, monkeypatch):
    build = make_build(5)
    lay = layout(build)
    out = tmp_path / "out"
    out.mkdir()
    before_rows, before_files = log_rows(lay), tree(build)
    for sql in attacks(lay.events, out):
        cli_refuses(build, sql, capsys)
    monkeypatch.setattr(query_mod, "check_read_only", lambda sql: None)
    for sql in attacks(lay.events, out):
        try_raw(lambda s: run_query(lay, s), sql)
    assert log_rows(lay) == before_rows
    assert tree(build) == before_files  # byte-identical log, no WAL, nothing new
    assert list(out.iterdir()) == []
    assert run_query(lay, "SELECT count(*) FROM samples")[1] == [[5]]  # still readable


def test_live_run_log_cannot_be_changed_by_any_statement(make_build, tmp_path, capsys, hold):
    build = make_build(12, seed=5)
    lay = layout(build)
    out = tmp_path / "out"
    out.mkdir()
    # still going after the attacks, for certain: its worker holds with its 5th sample started (the test hook) until
    # the Ctrl-C that stops it; the 4 before it written one a group
    h = hold(5)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        h.wait(proc=p)
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None and time.monotonic() < deadline, "the run ended or never got going"
            try:
                if run_query(lay, "SELECT count(*) FROM events WHERE kind = 'written'")[1][0][0] >= 3:
                    break
            except QueryError:
                pass
            time.sleep(0.2)
        snap_sql = "SELECT seq, kind, sample_id FROM events WHERE seq <= {k} ORDER BY seq"
        k = run_query(lay, "SELECT max(seq) FROM events")[1][0][0]
        before = run_query(lay, snap_sql.format(k=k))[1]
        for sql in attacks(lay.events, out):
            cli_refuses(build, sql, capsys)
        assert p.poll() is None, "the run should still be going"
        assert run_query(lay, snap_sql.format(k=k))[1] == before
        n, top = run_query(lay, "SELECT count(*), max(seq) FROM events")[1][0]
        assert n == top  # no gap: nothing deleted
    finally:
        p.send_signal(signal.SIGINT)
        h.release()
        _, err = p.communicate(timeout=120)
    assert p.returncode in (0, 130), err
    rows = log_rows(lay)
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
    assert [(r[0], r[1], r[2]) for r in rows[:k]] == [tuple(r) for r in before]
    assert list(out.iterdir()) == []
    assert not (build / "zz").exists()


def test_owner_replica_is_the_guard_not_the_allowlist(make_build, tmp_path, no_allowlist):
    """An owner in this process (its socket server and a writer thread appending), the allowlist off."""
    build = make_build(5)
    lay = layout(build)
    out = tmp_path / "out"
    out.mkdir()
    log = EventLog(lay.events)
    server = QueryServer(lay.root / "hsbuild.sock", log, lambda: {"running": True, **log.progress()}).start()
    stop = threading.Event()
    appended = []

    def writer() -> None:
        while not stop.is_set():
            log.append([Event("paused", run_id="writer", reason="test")])
            appended.append(log._seq)
            time.sleep(0.01)

    # the lock record points clients at the server (a real owner holds the build lock while it serves)
    from builder.log.lock import BuildLock  # noqa: PLC0415

    with BuildLock(lay, "run", "writer"):
        w = threading.Thread(target=writer, daemon=True)
        w.start()
        try:
            while len(appended) < 3:
                time.sleep(0.01)
            k = run_query(lay, "SELECT max(seq) FROM events")[1][0][0]
            snap = f"SELECT seq, kind FROM events WHERE seq <= {k} ORDER BY seq"
            before = run_query(lay, snap)[1]
            assert len(before) == k
            for sql in attacks(lay.events, out):
                try_raw(lambda s: run_query(lay, s), sql)
            assert run_query(lay, snap)[1] == before
            # a replica sees the owner's latest commits
            committed = len(appended)
            assert run_query(lay, "SELECT count(*) FROM events WHERE kind = 'paused'")[1][0][0] >= committed
        finally:
            stop.set()
            w.join()
            server.stop()
    n, top = log.con.execute("SELECT count(*), max(seq) FROM events").fetchone()
    log.close()
    assert n == top and n == 1 + len(appended)  # init + every append; nothing deleted, nothing added
    assert list(out.iterdir()) == []
