"""What a live owner answers while its log is slow or held (issue 44, point 4; docs/design.md, "Fresh answers"): a
slow answer is waited for (fresh), an older one comes only while a log commit begun before it is pending (and holds
it), and it says how old it is. A real owner session on a real build; the pending commit is the session's own tracked
commit (`watch.track`), held open from a thread as a commit the volume holds would be."""

from __future__ import annotations

import threading
import time

from builder.layout import layout
from builder.log.events import Event
from builder.log.query import run_query, stale_note, status_snapshot
from builder.log.session import OwnerSession

SLOW_S = 2.5  # a status that takes this long to compute (a big log): longer than the 1 s a held log is given


def test_a_slow_status_is_waited_for_and_a_held_log_answers_from_before_saying_when(make_build):
    lay = layout(make_build(3))
    calls = []

    with OwnerSession(lay, "run", signals=False) as s:
        def status() -> dict:
            calls.append(time.monotonic())
            time.sleep(SLOW_S)
            return {"running": True, "purpose": "run", **s.log.progress()}

        s.status_fn = status
        s.open(signals=False)
        s.emit(Event("gpu_stats", detail="{}"))
        s.flush(force=True)
        t0 = time.monotonic()
        st = status_snapshot(lay)  # slow, the log answering: waited for, fresh
        assert time.monotonic() - t0 >= SLOW_S and not st.get("stale") and st["as_of"] >= time.time() - 10, st
        cols, rows = run_query(lay, "SELECT count(*) FROM events WHERE kind = 'gpu_stats'")
        assert rows == [[1]]

        release = threading.Event()
        started = threading.Event()

        def held_commit() -> None:  # a commit the volume holds (the session's stall watch tracks it)
            with s.watch.track("log commit", lay.events):
                started.set()
                release.wait(30)

        holder = threading.Thread(target=held_commit)
        holder.start()
        started.wait(5)
        try:
            time.sleep(0.6)  # pending longer than the replica waits behind it
            t0 = time.monotonic()
            st = status_snapshot(lay)
            took = time.monotonic() - t0
            assert st.get("stale") and st["as_of"] < time.time() - SLOW_S and took < SLOW_S, (took, st)
            # sql's snapshot is not held by that commit here (its read goes on): a fresh answer, no note (one it
            # held is answered from the last snapshot, named: tests/durability/test_stall.py)
            notes: list[str] = []
            cols, rows = run_query(lay, "SELECT count(*) FROM events WHERE kind = 'gpu_stats'", on_note=notes.append)
            assert rows == [[1]] and notes == [], notes
        finally:
            release.set()
            holder.join()
        s.emit(Event("gpu_stats", detail="{}"))  # the log answers again: fresh again
        s.flush(force=True)
        notes = []
        cols, rows = run_query(lay, "SELECT count(*) FROM events WHERE kind = 'gpu_stats'", on_note=notes.append)
        assert rows == [[2]] and notes == []


def test_a_stale_note_says_why_and_how_old():
    now = time.time()
    held = stale_note({"early": True, "held": True, "pending_s": 1.5}, now - 3)
    assert "pending 1.5 s" in held and "(3.0 s ago)" in held
    slow = stale_note({"early": True, "held": False}, now - 40)
    assert "--timeout" in slow and "(40.0 s ago)" in slow
    named = stale_note({"what": "log commit", "pending_s": 31, "path": "/b/events.duckdb", "filesystem": "ext4 at /"},
                       now - 31)
    assert named.startswith("STALLED: log commit pending 31 s on /b/events.duckdb")


def test_status_prints_the_age_of_stale_figures():
    from builder.cli.app import status_lines  # noqa: PLC0415

    st = {"running": True, "run_id": "r" * 32, "pid": 1, "workers": 1, "stale": True, "as_of": time.time() - 12,
          "total": 3, "done": 1, "written": 1, "verified": 0, "failed": 0, "started": 0, "pending": 2,
          "tokens_done": 10, "tokens_total": 30, "bytes_done": 100}
    note = [line for line in status_lines(st) if line.startswith("note:")]
    assert len(note) == 1 and "(12 s ago)" in note[0], status_lines(st)
    assert not [line for line in status_lines({**st, "stale": False}) if line.startswith("note:")]
