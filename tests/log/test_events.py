"""The event log refuses a second writer loudly, and an existing log is upgraded to the unique `seq` index; an
event's time is its commit's; a log this version cannot make its views over is refused in one line."""

from __future__ import annotations

import json

import duckdb
import pytest
from conftest import ROOMY, fill_with_log, random_rows, write_jsonl

from builder.errors import LogConflictError
from builder.layout import layout
from builder.log.events import Event, EventBatch, EventLog, utcnow
from builder.run.create import init_build


def seqs(path) -> list[int]:
    with EventLog(path, read_only=True) as log:
        return [r[0] for r in log.query("SELECT seq FROM events ORDER BY seq")[1]]


def test_a_second_writer_fails_loudly_instead_of_interleaving(make_build):
    lay = layout(make_build(3))
    a = EventLog(lay.events)
    b = EventLog(lay.events)  # a second owner that opened the log at the same moment (its seq is now stale)
    try:
        a.append([Event("paused", run_id="a", reason="x")])
        with pytest.raises(LogConflictError) as e:
            b.append([Event("paused", run_id="b", reason="x")])
        assert "another process appended" in str(e.value)
        b._seq = 0  # even a writer that skips the check cannot reuse a seq: the unique index refuses it
        with pytest.raises(LogConflictError):
            b.append([Event("paused", run_id="b", reason="x")])
        a.append([Event("resumed", run_id="a")])  # the rightful owner goes on
    finally:
        a.close()
        b.close()
    assert seqs(lay.events) == [1, 2, 3]


def test_an_existing_log_gets_the_unique_seq_index(make_build):
    lay = layout(make_build(3))
    con = duckdb.connect(str(lay.events))  # a log as an older hsbuild left it: no index, older digest
    con.execute("DROP INDEX IF EXISTS events_seq")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_digest'", [json.dumps("older")])
    con.close()
    with EventLog(lay.events) as log:
        assert log.query("SELECT index_name FROM duckdb_indexes() WHERE table_name = 'events'")[1] == [("events_seq",)]
        log.append([Event("paused", run_id="r", reason="x")])
    assert seqs(lay.events) == [1, 2]


def test_a_log_two_writers_already_interleaved_is_named_on_upgrade(make_build):
    lay = layout(make_build(3))
    con = duckdb.connect(str(lay.events))
    con.execute("DROP INDEX IF EXISTS events_seq")
    con.execute("INSERT INTO events (seq, ts, kind) VALUES (1, now()::timestamp, 'paused')")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_digest'", [json.dumps("older")])
    con.close()
    with pytest.raises(LogConflictError) as e:
        EventLog(lay.events)
    assert "share a seq number" in str(e.value)
    assert seqs(lay.events) == [1, 1]  # read-only opening still works, and nothing was changed


def test_status_and_sql_read_a_log_an_older_hsbuild_wrote_with_this_versions_views(make_build, cli):
    """A user upgrades hsbuild and asks `status` (read-only: nothing upgrades the file) of a build an older
    version left: older views (here a `progress` without the projection's inputs) and a fold checkpoint of an
    older layout.
    Both answer with this version's views, and the file is left exactly as it was."""
    build = make_build(5)
    cli("run", build, "--no-progress", check=True)
    lay = layout(build)
    con = duckdb.connect(str(lay.events))
    con.execute("CREATE OR REPLACE VIEW progress AS SELECT 1 AS total")
    # an older checkpoint layout (no `imports`), empty, yet marked as folding every event: were it read, every
    # sample would look pending
    con.execute("ALTER TABLE fold_checkpoint DROP COLUMN imports")
    con.execute("DELETE FROM fold_checkpoint; DELETE FROM fold_checkpoint_mark")
    con.execute("INSERT INTO fold_checkpoint_mark SELECT max(seq) FROM events")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_digest'", [json.dumps("older")])
    con.close()
    before = lay.events.read_bytes()
    st = json.loads(cli("status", build, "--json", check=True).stdout)
    assert (st["total"], st["done"], st["todo_samples"], st["failed_by_reason"]) == (5, 5, 0, {})
    assert st["final_bytes"] >= st["disk_bytes_done"] > 0
    out = cli("sql", build, "SELECT total, written, todo_samples FROM progress", "--csv", check=True).stdout
    assert out.split() == ["total,written,todo_samples", "5,5,0"]
    assert lay.events.read_bytes() == before


def test_a_batch_committed_after_a_full_disk_bears_the_time_of_its_commit(tmp_path, tmpfs):
    """A batch whose commits fail for lack of space (retried with backoff) and then go through: its events' `ts`
    is when they became durable, not when the first try was made (a 'last event at' or a rate read from the log
    would otherwise place them before the stall)."""
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(3))
    lay = layout(init_build(tmpfs / "build", src, watermarks=ROOMY).root)
    log = EventLog(lay.events)
    batch = EventBatch(log, "r", wait=60)
    batch.emit(Event("run_started"))
    assert batch.flush(force=True)
    fill_with_log(log, tmpfs / "filler.bin")
    top = log._seq
    for i in range(3):
        batch.emit(Event("written", sample_id=f"s{i}", attempt=1))
    batch.last_commit -= 10  # due
    assert batch.flush() is False and batch.stalled  # the first try fails: the disk is full
    freed = utcnow()
    (tmpfs / "filler.bin").unlink()  # space returns
    assert batch.flush(force=True)
    committed = utcnow()
    stamps = [r[0] for r in log.query(f"SELECT ts FROM events WHERE seq > {top} ORDER BY seq")[1]]
    log.close()
    assert len(stamps) == 3
    assert all(freed <= ts <= committed for ts in stamps), (freed, stamps, committed)


def test_a_log_this_versions_views_cannot_be_made_over_is_refused_in_one_line(make_build, cli):
    """A log an older hsbuild (or damage) left without a table this version's views read: `status` and `sql`
    (read-only: TEMP views) and `resume` (an owner: the file's views) each say so in one line naming the file,
    what failed and the way out (exit 2), instead of answering with the file's older views or failing later
    with 'Table with name progress does not exist'. The file is left as it was."""
    build = make_build(3)
    cli("run", build, "--no-progress", check=True)
    lay = layout(build)
    con = duckdb.connect(str(lay.events))
    for (view,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall():
        con.execute(f"DROP VIEW IF EXISTS {view} CASCADE")
    con.execute("DROP TABLE source_samples")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_digest'", [json.dumps("older")])
    con.close()
    before = lay.events.read_bytes()
    for args in (("status", build), ("sql", build, "SELECT count(*) FROM samples"), ("resume", build, "--no-progress")):
        cp = cli(*args)
        assert cp.returncode == 2, (args, cp.stdout, cp.stderr)
        errors = [line for line in cp.stderr.splitlines() if line.startswith(f"hsbuild {args[0]}: error:")]
        assert len(errors) == 1 and "Traceback" not in cp.stderr, cp.stderr
        assert str(lay.events) in errors[0] and "source_samples" in errors[0], errors[0]
        assert f"hsbuild rebuild-log {build}" in errors[0], errors[0]
        assert lay.events.read_bytes() == before
