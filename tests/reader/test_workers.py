"""DataLoader workers, forked or spawned, read exactly the items of the dataset they were given: the parent's index
(a mapped file when the cache can hold it, else arrays pickled with the dataset), never one rebuilt from the log
as it is by then. Real builds, real worker processes."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import random_rows
from test_index import FORMATS, same
from torch.utils.data import DataLoader, StackDataset

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
        local = [collate_concat(want[k:k + 4]) for k in range(0, 9, 4)]  # (the batches made in this process)
        assert all(type(b) is dict for b in batches) and same(batches, local)  # (from a worker: one buffer each)


def test_batches_and_items_from_workers_are_the_items_read_one_by_one_for_every_format(built):
    """`__getitems__` (a batch read in storage order) gives each item `ds[i]` gives, in the order asked, for every
    format; and what a worker sends (one buffer an item, builder/reader/shipping.py) arrives as the same plain
    dicts of plain tensors, forked or spawned, batched or one at a time."""
    dss = [HiddenStateDataset(built, format=fmt) for fmt in FORMATS]
    want = [[ds[i] for ds in dss] for i in range(9)]
    order = [5, 0, 8, 3, 3, 1, 7, 2, 6, 4, -1]  # shuffled, one twice, one from the end
    for ds, fmt in zip(dss, FORMATS, strict=True):
        got = ds.__getitems__(order)
        assert len(got) == len(order) and all(same(g, w[FORMATS.index(fmt)])
                                               for g, w in zip(got, [want[i] for i in order], strict=True))
        assert all(type(g) is dict for g in got)  # (the training process's own reads: plain dicts)
        twice = [got[3], got[4]]  # (entry 3 asked twice: read once, never the same tensors given twice)
        assert all(a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                   for a, b in zip(*[[v for v in t.values() if isinstance(v, torch.Tensor) and v.numel()]
                                     for t in twice], strict=True)), fmt
    both = StackDataset(*dss)  # each item: the items of every format (StackDataset calls each one's __getitems__)
    for context in ("fork", "spawn"):
        batches = list(DataLoader(both, sampler=order, batch_size=4, collate_fn=list, num_workers=2,
                                  multiprocessing_context=context))
        got = [it for b in batches for it in b]
        assert [len(b) for b in batches] == [4, 4, 3], context
        ones = list(DataLoader(both, sampler=order, batch_size=None, num_workers=2, multiprocessing_context=context))
        for items in (got, ones):
            assert len(items) == len(order)
            for it, i in zip(items, order, strict=True):
                assert all(type(x) is dict for x in it), context  # never the worker's own type
                assert all(type(v) is torch.Tensor for x in it for v in x.values() if isinstance(v, torch.Tensor))
                assert same(list(it), want[i]), (context, i)


def test_what_a_worker_sends_arrives_as_the_same_plain_dict_whatever_its_tensors():
    """One buffer for the tensors it can carry (any dtype, empty, 0-d), torch's way for the others (a view that is
    not contiguous, one needing grad, an item above SHIP_BYTES); keys in order, values equal, each tensor its own."""
    import pickle  # noqa: PLC0415
    from multiprocessing.reduction import ForkingPickler  # noqa: PLC0415

    from builder.reader.shipping import SHIP_BYTES, Shipped, ShippedList  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    small = {"sample_id": "s0001", "input_ids": torch.arange(7), "bf16": torch.randn(7, 64, generator=g).bfloat16(),
             "empty": torch.zeros(0, 3, dtype=torch.bfloat16), "scalar": torch.tensor(2.5, dtype=torch.float16),
             "flags": torch.tensor([True, False, True]), "strided": torch.arange(12).reshape(3, 4)[:, ::2],
             "grad": torch.ones(2, requires_grad=True), "flag": False}
    big = {"x": torch.randn(SHIP_BYTES // 4 + 1, generator=g), "y": torch.arange(3)}
    for want in (small, big):
        got = pickle.loads(ForkingPickler.dumps(Shipped(want)))
        assert type(got) is dict and list(got) == list(want)
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert type(got[k]) is torch.Tensor and got[k].dtype == v.dtype and got[k].shape == v.shape, k
                assert torch.equal(got[k].detach(), v.detach()) and got[k].requires_grad == v.requires_grad, k
            else:
                assert got[k] == v and type(got[k]) is type(v), k
        carried = [v for v in got.values() if isinstance(v, torch.Tensor) and v.is_contiguous()]
        assert len({v.untyped_storage().data_ptr() for v in carried if v.numel()}) == len([v for v in carried
                                                                                          if v.numel()])
    # a group (HiddenStateDataset.loader): one buffer for all its dicts' tensors (up to SHIP_BYTES), a plain list
    other = {k: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
             for k, v in small.items()}  # (the same values in other tensors, as two items read are)
    for group in ([Shipped(small), "s0002", Shipped(other), {"plain": torch.arange(3)}], [Shipped(small), Shipped(big)]):
        got = pickle.loads(ForkingPickler.dumps(ShippedList(group)))
        assert type(got) is list and len(got) == len(group)
        for g, w in zip(got, group, strict=True):
            assert type(g) is type(w) if not isinstance(w, Shipped) else type(g) is dict
            if isinstance(w, dict):
                assert list(g) == list(w) and all(
                    torch.equal(g[k].detach(), v.detach()) and g[k].dtype == v.dtype if isinstance(v, torch.Tensor)
                    else g[k] == v for k, v in w.items())
        tensors = [v for g in got if isinstance(g, dict) for v in g.values()
                   if isinstance(v, torch.Tensor) and v.is_contiguous() and v.numel()]
        assert len({v.untyped_storage().data_ptr() for v in tensors}) == len(tensors)  # each its own
