"""Fresh answers during a run (issue 44, point 4): `hsbuild sql` and `hsbuild status`, asked from another process
while a run writes, include every event the run committed more than 2 s before the question, on a build whose log
is already long (the first snapshot of it takes longer than a moment: it must answer, not blame the storage).

"Committed" is what the log holds: an event counts from its transaction's commit (`ts` is taken just before it).
The check is made after the run, against the log itself: for each answer, the `written` events with `ts` at least
2 s before the question are a lower bound of its count, those with `ts` before the answer came an upper bound."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import forked

from builder.layout import layout
from builder.log.query import run_query

N = 300  # samples of the run: a few seconds of writing with one worker, groups of 4 samples
HISTORY = 3_000_000  # events of an earlier history (`gpu_stats`, no sample's): a snapshot of them takes ~1 CPU-s
FRESH_S = 2.0
WRITTEN = "SELECT count(*) FROM samples WHERE state = 'written'"


def grow_log(build: Path, n: int) -> None:
    """The log of a build that has lived long: `n` run events of an earlier run appended (what a GPU run's
    `gpu_stats` leave every few seconds), written with DuckDB as an owner would (no process owns the build)."""
    con = duckdb.connect(str(layout(build).events))
    try:
        top = con.execute("SELECT max(seq) FROM events").fetchone()[0]
        con.execute(f"""INSERT INTO events (seq, ts, kind, run_id, detail)
                        SELECT {top} + 1 + i, TIMESTAMP '2026-01-01' + to_seconds(i * 5), 'gpu_stats', 'earlier-run',
                               '{{"devices": [{{"index": 0, "util": ' || (i % 100) || ', "mem_used": 1000}}]}}'
                        FROM range({n}) t(i)""")
    finally:
        con.close()


def _ask(build: Path, args: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    asked = time.time()
    r = subprocess.run([sys.executable, "-m", "builder.cli", *args], capture_output=True, text=True, timeout=120)
    return asked, time.time(), r


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC).replace(tzinfo=None)


def test_sql_and_status_during_a_run_include_every_commit_older_than_two_seconds(make_build, hold):
    build = make_build(N, seed=3)
    grow_log(build, HISTORY)
    start = hold(1)
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**start.env, "HSBUILD_GROUP_SAMPLES": "4"})
    answers = []
    try:
        start.wait(proc=p)  # the run certainly goes: every answer below is the owner's
        start.release()
        while p.poll() is None:
            answers.append(("sql", *_ask(build, ["sql", str(build), WRITTEN, "--json"])))
            if p.poll() is None:
                answers.append(("status", *_ask(build, ["status", str(build), "--json"])))
    finally:
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]

    written = [r[0] for r in run_query(layout(build), "SELECT ts FROM events WHERE kind = 'written' ORDER BY ts")[1]]
    assert len(written) == N
    stamps = [dt.datetime.fromisoformat(t) for t in written]
    during = 0
    for what, asked, answered, r in answers:
        assert r.returncode == 0, (what, r.stderr)  # (a big log's first snapshot is slow, never "stalled volume?")
        got = json.loads(r.stdout)
        if what == "status" and not got.get("running"):
            continue  # (the run had ended: answered from the file)
        count = got[0]["count_star()"] if what == "sql" else got["written"]
        older = sum(s <= _utc(asked - FRESH_S) for s in stamps)
        before = sum(s <= _utc(answered) for s in stamps)
        assert older <= count <= before, (f"{what} asked at {_utc(asked)} answered {count}: {older} were committed "
                                         f"{FRESH_S:g} s before, {before} before the answer", r.stderr)
        during += 0 < count < N
    assert during >= 4, f"only {during} answers came while the run wrote: {[(a[0], a[3].stdout) for a in answers]}"
