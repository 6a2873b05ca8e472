"""`HiddenStateDataset.loader` (builder/reader/loader.py): its workers send a group of items or batches a message,
and what the training process gets is exactly what the DataLoader of the same arguments gives with no workers
(values, order for a given sampler or seed, every format), forked or spawned, one item at a time or in batches;
a damaged sample raises where the DataLoader raises it, and the items after it still come. Real builds, real
worker processes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import random_rows
from test_index import FORMATS, same
from torch.utils.data import DataLoader

from builder.errors import DamagedSampleError
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.reader import HiddenStateDataset, collate_concat
from builder.reader.loader import GroupedLoader
from builder.run.coordinator import RunOptions, run_build


@pytest.fixture
def built(make_build):
    build = make_build(rows=random_rows(9, seed=2, lo=3, hi=30))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 9
    return build


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


# (batch_size, the DataLoader's other arguments): one at a time in order and shuffled, batches of every kind
CASES = [
    (None, {}),
    (None, {"shuffle": True, "generator": "seeded"}),
    (None, {"sampler": [5, 0, 8, 3, 3, 1, 7, 2, 6, 4, -1]}),  # one twice, one from the end
    (2, {"shuffle": True, "generator": "seeded", "collate_fn": collate_concat}),  # a short last batch
    (2, {"shuffle": True, "collate_fn": list, "drop_last": True}),  # (the global seed: torch.manual_seed below)
    (4, {"sampler": [8, 7, 6, 5, 4, 3, 2, 1, 0], "collate_fn": list}),
]


def _args(kw: dict) -> dict:
    return {k: (_generator() if v == "seeded" else v) for k, v in kw.items()}


def _read(make, ds, batch_size, kw, **workers) -> list:
    torch.manual_seed(11)  # (a shuffle without a generator draws from the global one, as the DataLoader's does)
    return list(make(ds, batch_size, **_args(kw), **workers))


def _plain(ds, batch_size, **kw):
    return DataLoader(ds, batch_size=batch_size, **kw)


def _loader(ds, batch_size, **kw):
    return ds.loader(batch_size, **kw)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_loader_gives_what_the_dataloader_gives_with_no_workers(built, context):
    ds = HiddenStateDataset(built)
    for batch_size, kw in CASES if context == "fork" else [CASES[1], CASES[3]]:  # (spawned workers: seconds each)
        want = _read(_plain, ds, batch_size, kw)
        loader = ds.loader(batch_size, num_workers=2, multiprocessing_context=context, items_per_message=4, **_args(kw))
        assert isinstance(loader, GroupedLoader) and len(loader) == len(want), (batch_size, kw)
        got = _read(_loader, ds, batch_size, kw, num_workers=2, multiprocessing_context=context, items_per_message=4)
        assert len(got) == len(want) and same(got, want), (context, batch_size, kw)
        assert all(type(x) is (list if kw.get("collate_fn") is list else dict) for x in got)
        assert all(type(v) is torch.Tensor for x in got for it in (x if type(x) is list else [x])
                   for v in it.values() if isinstance(v, torch.Tensor))  # plain tensors, never the worker's types
    # each epoch of a loader iterated again: the DataLoader's next epoch (another shuffle of the same generator)
    g1, g2 = _generator(), _generator()
    plain = DataLoader(ds, batch_size=None, shuffle=True, generator=g1)
    loader = ds.loader(None, shuffle=True, generator=g2, num_workers=2, multiprocessing_context=context)
    for _ in range(2):
        assert same(list(loader), list(plain)), context


def test_the_loader_gives_every_formats_items(built):
    for fmt in FORMATS[1:]:
        ds = HiddenStateDataset(built, format=fmt)
        for batch_size, kw in (CASES[1], CASES[5]):
            want = _read(_plain, ds, batch_size, kw)
            got = _read(_loader, ds, batch_size, kw, num_workers=2, multiprocessing_context="fork")
            assert len(got) == len(want) and same(got, want), (fmt, batch_size)


def test_the_workers_send_groups(built):
    """What makes the loader cheaper than the DataLoader: a message carries several items (or batches), up to
    items_per_message; batches bigger than that travel one a message."""
    ds = HiddenStateDataset(built)
    for batch_size, per_message, sizes in ((None, 4, [4, 4, 1]), (2, 4, [2, 2, 1]), (4, 2, [1, 1, 1])):
        collate = list if batch_size else None
        loader = ds.loader(batch_size, collate_fn=collate, num_workers=2, multiprocessing_context="fork",
                           items_per_message=per_message)
        groups = list(loader.inner)
        assert [len(g) for g in groups] == sizes, (batch_size, per_message)
        assert same([x for g in groups for x in g], list(DataLoader(ds, batch_size=batch_size, collate_fn=collate)))
    assert type(ds.loader(None)) is DataLoader and type(ds.loader(None, num_workers=2, items_per_message=1)) is DataLoader


def test_a_damaged_sample_raises_where_the_dataloader_raises_it_and_the_items_after_it_still_come(built):
    lay = layout(built)
    ds0 = HiddenStateDataset(built)
    e = ds0.index[4]
    wrong = json.loads(ds0.index[5]["checksums"])  # another sample's checksums: a mismatch
    with EventLog(lay.events) as log:
        log.append([Event("written", run_id="test", sample_id=e["sample_id"], attempt=1, segment=e["segment"],
                          token_start=e["token_start"], num_tokens=e["num_tokens"], nbytes=1,
                          checksums=json.dumps(wrong, sort_keys=True))])
    ds = HiddenStateDataset(built)

    def outcomes(loader) -> list:
        """Each item (or batch) the loader gives, or the error's text in its place, going on after it."""
        out, it = [], iter(loader)
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except Exception as err:  # noqa: BLE001 - torch's: a RuntimeError "Caught DamagedSampleError in ..."
                lines = [line for line in str(err).splitlines() if line.strip()]
                # (not the traceback between, whose frames differ, nor which worker read it)
                out.append((type(err).__name__, re.sub(r"worker process \d+", "worker", lines[0]), lines[-1]))

    for batch_size, collate in ((None, None), (2, list)):
        want = outcomes(DataLoader(ds, batch_size=batch_size, collate_fn=collate, num_workers=2,
                                   multiprocessing_context="fork"))
        assert sum(isinstance(x, tuple) for x in want) == 1 and len(want) == (9 if batch_size is None else 5)
        said = next(x for x in want if isinstance(x, tuple))
        assert said[1].startswith(f"Caught {DamagedSampleError.__name__}") and "checksum mismatch" in said[2], said
        got = outcomes(ds.loader(batch_size, collate_fn=collate, num_workers=2, multiprocessing_context="fork",
                                 items_per_message=4))
        assert len(got) == len(want) and same(got, want), batch_size
