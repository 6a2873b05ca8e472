"""The reader's index made during a run is asked of the run (its `arrow` op: Arrow tables over its socket, one
snapshot of its replica, builder/log/bulk.py) and gives, for every sample written by then, exactly the entry and
item the index of the finished build gives. A real run, held mid-way by the test hook."""

from __future__ import annotations

import subprocess
import sys

import forked
from conftest import random_rows, wait_for
from test_index import reference, same

from builder.layout import layout
from builder.log.query import status_snapshot
from builder.reader import HiddenStateDataset
from builder.reader import snapshot as snap


def test_an_index_made_during_a_run_is_the_finished_builds_for_the_samples_written(make_build, hold, monkeypatch):
    build = make_build(rows=random_rows(10, seed=5, lo=3, hi=30))
    h = hold(6)  # the worker holds with its 6th sample started: 5 written (one a group), the run still going
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--workers", "1", "--no-progress"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                     env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    made: list[str] = []  # where each snapshot was read

    def read_columns(*a, f=snap.read_columns, **k):
        where, tables = f(*a, **k)
        made.append(where)
        return where, tables

    try:
        h.wait(proc=p)
        wait_for(lambda: status_snapshot(layout(build)).get("done", 0) >= 5, 120, "5 samples written", p)
        monkeypatch.setattr(snap, "read_columns", read_columns)
        live = HiddenStateDataset(build)
        live_sf = HiddenStateDataset(build, format="specforge")
        want = reference(build)  # the samples view, asked of the run as `hsbuild sql` asks it
        assert made and set(made) == {"owner"}
        assert list(live.index) == want and len(live) == 5
        items = [live[i] for i in range(len(live))]
        items_sf = [live_sf[i] for i in range(len(live_sf))]
    finally:
        h.release()
        out = p.communicate(timeout=240)[1] if p.poll() is None else p.stderr.read()
    assert p.returncode == 0, out
    del made[:]
    done = HiddenStateDataset(build)
    done_sf = HiddenStateDataset(build, format="specforge")
    assert made == ["file"] and len(done) == 10
    assert done.index.key != live.index.key and done.index.path != live.index.path
    at = done.by_id()
    for i, e in enumerate(live.index):
        j = at[e["sample_id"]]
        assert done.index[j] == e
        assert same(done[j], items[i]) and same(done_sf[j], items_sf[i])
