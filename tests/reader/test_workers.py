"""DataLoader workers, forked or spawned, read exactly the items of the dataset they were given: the parent's index
(a mapped file when the cache can hold it, else arrays pickled with the dataset), never one rebuilt from the log
as it is by then. Real builds, real worker processes."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import random_rows
from test_index import same
from torch.utils.data import DataLoader

from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.reader import HiddenStateDataset, collate_concat
from builder.run.coordinator import RunOptions, run_build


@pytest.fixture
def built(make_build):
    build = make_build(rows=random_rows(9, seed=2, lo=3, hi=30))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 9
    return build


def _items(ds, **loader) -> list:
    return list(DataLoader(ds, batch_size=None, **loader))


@pytest.mark.parametrize("cache", ["file", "memory"])
def test_forked_and_spawned_workers_read_the_parents_items(built, cache, monkeypatch, tmp_path):
    if cache == "memory":  # a cache folder that cannot be made (under a file): the index stays in memory
        (tmp_path / "a-file").write_text("")
        monkeypatch.setenv("HSBUILD_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    ds, sf = HiddenStateDataset(built), HiddenStateDataset(built, format="specforge")
    assert (ds.index.path is None) == (cache == "memory")
    want = [ds[i] for i in range(len(ds))]
    want_sf = [sf[i] for i in range(len(sf))]
    # the log moves on after the datasets were made (a sample retired): the workers still read the parent's items
    with EventLog(layout(built).events) as log:
        log.append([Event("retired", run_id="test", sample_id="s0003", reason="skipped")])
    assert len(HiddenStateDataset(built)) == 8
    assert len(pickle.dumps(ds)) < 16384  # what a spawned worker is sent: no per-sample objects
    contexts = ["spawn"] if cache == "memory" else ["fork", "spawn"]  # (forked: the same memory, in any case)
    for context in contexts:
        got = _items(ds, num_workers=2, multiprocessing_context=context)
        assert len(got) == len(want) == 9 and all(same(a, b) for a, b in zip(got, want, strict=True)), context
    if cache == "file":
        got = _items(sf, num_workers=2, multiprocessing_context="fork")
        assert len(got) == 9 and all(same(a, b) for a, b in zip(got, want_sf, strict=True))
        batches = list(DataLoader(ds, batch_size=4, collate_fn=collate_concat, num_workers=2,
                                  multiprocessing_context="fork"))
        assert torch.equal(torch.cat([b["hidden_state"] for b in batches]),
                           torch.cat([it["hidden_state"] for it in want]))
