"""Issue 30: `status` and `sql` answer from the moment a run holds the build, also while it is still starting
(reading a big source takes minutes on a million rows), instead of "does not answer queries (still starting?)".

Deterministic: the run (in this process) is held inside its source read by a hook until the questions are asked
through the owner's socket, from another thread, as another shell would."""

from __future__ import annotations

import threading
import time

from builder.extract import source as sources
from builder.layout import layout
from builder.log.query import OWNER_WAIT_S, run_query, status_snapshot
from builder.run.coordinator import RunOptions, run_build


def test_status_says_the_phase_and_sql_waits_while_the_run_starts(make_build, monkeypatch):
    build = make_build(6, seed=4)
    seen: dict = {}
    asked = threading.Event()
    real = sources.load_source

    def ask() -> None:
        t0 = time.monotonic()
        seen["status"] = status_snapshot(layout(build))  # (the owner answers at once; the client waits a moment)
        seen["status_s"] = time.monotonic() - t0
        asker = seen["asker"] = threading.Thread(target=lambda: seen.setdefault(
            "rows", run_query(layout(build), "SELECT count(*) FROM samples", 30)[1]))
        asker.start()
        time.sleep(1.0)
        seen["sql_waiting"] = asker.is_alive()  # sql waits for the log (within its timeout) instead of failing
        asked.set()

    def slow_source(*args, **kwargs):  # (the run, in this main thread, is reading its source)
        threading.Thread(target=ask, daemon=True).start()
        assert asked.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(sources, "load_source", slow_source)  # (the library's source reader, as the run calls it)
    report = run_build(build, RunOptions(workers=1), echo=lambda m: None)
    assert report.exit_code == 0
    st = seen["status"]
    assert st["running"] and st["purpose"] == "run" and st["phase"] == "starting: reading the source", st
    # status shows the phase after a moment (STATUS_START_WAIT_S), not after the wait for an owner that does not
    # answer at all (OWNER_WAIT_S); sql waits for the log
    assert seen["status_s"] < OWNER_WAIT_S and seen["sql_waiting"], seen
    seen["asker"].join(60)
    assert seen["rows"] == [[6]]
