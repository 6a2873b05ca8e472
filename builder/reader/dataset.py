"""A torch reader for training: the live samples of a build, in source order.

The index is a snapshot of the `samples` view (taken from the live owner during a run, or from the file), so
only samples whose `written` event committed are ever returned, whatever else sits on disk. It is columns of
numbers (builder/reader/index.py, about 70 B a sample), kept in a file of the user's cache folder that every
process maps, made once per state of the log (builder/reader/snapshot.py): DataLoader workers, forked or
spawned, read the parent's index and never make their own. `ds.loader(...)` is the DataLoader of the same
arguments whose workers send a group of items or batches a message (builder/reader/loader.py).

Every item is read checked: each chunk file the sample needs must be present (Zarr would return zeros for a
missing one) and, unless `verify_checksums=False`, each field's CRC-32C must match the sample's `written`
event. A damaged sample raises `DamagedSampleError` naming the sample, segment, field and the repair
(`hsbuild verify BUILD`, then `hsbuild resume BUILD`); it is never returned as zeros.
"""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from builder.errors import DamagedSampleError, FormatError
from builder.formats import registry
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.log.query import run_query
from builder.reader.index import ReaderIndex
from builder.reader.loader import ITEMS_PER_MESSAGE, make_loader
from builder.reader.shipping import Shipped
from builder.reader.snapshot import load_index
from builder.store.reader import SegmentReader


class HiddenStateDataset(Dataset):
    """Items are dicts: sample_id, input_ids (int64 [n]), loss_mask (int64 [n]), hidden_state [n, H] and
    aux_hidden_state [n, n_aux*H] in the build's logical dtype (bfloat16 restored bit-exact).

    With `format=F` (a trainer's format that exports: "specforge", "speculators", "modelopt", or one registered
    with `builder.formats.register`; not "chat", whose lines are text) an item is exactly the dict that trainer's own
    dataset yields for the same sample (its keys, shapes, dtypes, layer order and final state before or after
    the norm; `max_len` truncates as specforge's dataset does; modelopt's items are its dataset's with
    answer_only_loss=True, the build's own loss mask), so a training script swaps its
    dataset for this one instead of exporting the build.

    A damaged sample raises `DamagedSampleError` (an OSError); `verify_checksums=False` skips the CRC-32C
    comparison (presence is always checked). Other OSErrors (EMFILE, EIO) propagate unchanged.

    `lossy` is None, or for an fp8 build its scheme and the measured error of these samples' states."""

    def __init__(self, build: str | Path, include_unverified: bool = True, verify_checksums: bool = True,
                 format: str | None = None, max_len: int | None = None):  # noqa: A002 - the trainers' word
        self.lay = layout(build).require()
        self.verify_checksums = verify_checksums
        self.format = None
        self._info: BuildInfo | None = None
        if format is not None:
            self.format = registry.make_format(format, flag="format", exports=True, states=True,
                                               max_len=max_len)
            self.info.require(self.format.final_state)
        elif max_len is not None:
            takers = [f.name for f in registry.formats(exports=True) if "max_len" in f.options]
            raise FormatError("max_len: only with " + " or ".join(f"format={t!r}" for t in takers))
        self.index: ReaderIndex = load_index(self.lay, include_unverified)
        self._reader: SegmentReader | None = None
        self._lossy: dict | None = None

    def __getstate__(self) -> dict:
        """What a DataLoader worker gets: the index (a mapped file's path, builder/reader/index.py), never this
        process's open reader."""
        return {**self.__dict__, "_reader": None}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def info(self) -> BuildInfo:
        if self._info is None:
            self._info = BuildInfo.load(self.lay)
        return self._info

    @property
    def lossy(self) -> dict | None:
        """None for a build that stores its states exactly; an fp8 build (`init --quantize fp8`): its scheme and
        the error measured when its samples were written, over this dataset's samples (builder/formats/lossy.py;
        what an export writes to hsbuild-lossy.json)."""
        if self.info.lossy is None:
            return None
        if self._lossy is None:
            from builder.formats.lossy import ERRORS_SQL, summarize  # noqa: PLC0415

            want = self.format.final_state if self.format is not None else None
            self._lossy = summarize(self.info, run_query(self.lay, ERRORS_SQL)[1], self.index.sample_ids(), want)
        return self._lossy

    def _reader_here(self) -> SegmentReader:
        if self._reader is None:  # opened lazily: one per DataLoader worker process
            self._reader = SegmentReader(self.lay.data, verify_checksums=self.verify_checksums)
        return self._reader

    def _read(self, i: int) -> tuple[int, dict]:
        """(entry position, the sample's tensors), read checked."""
        n = len(self.index)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        i = int(i) % n
        try:
            return i, self._reader_here().read(*self.index.location(i))
        except DamagedSampleError as err:
            raise err.with_context(sample_id=self.index.sample_id(i), build=str(self.lay.root)) from err.__cause__

    def _sample(self, i, j: int, t: dict, final_state: str | None = None):
        """Item i (entry j, its tensors `t`) as a trainer format's `Sample`."""
        from builder.formats.base import Sample  # noqa: PLC0415

        want = final_state or (self.format.final_state if self.format is not None else self.info.final_state)
        return Sample(self.index.sample_id(j), int(self.index.row_idx[j]), i, t["input_ids"].long(),
                      t["loss_mask"].long(), t["aux_hidden_state"], self.info.final(t["hidden_state"], want))

    def _item(self, i, j: int, t: dict) -> dict:
        """Item i (entry j, its tensors `t`)."""
        if self.format is not None:
            return self.format.item(self._sample(i, j, t))
        return {"sample_id": self.index.sample_id(j), "input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].long(),
                "hidden_state": t["hidden_state"], "aux_hidden_state": t["aux_hidden_state"]}

    def sample(self, i: int, final_state: str | None = None):
        """Item i as a trainer format's `Sample` (the final state in `final_state`, default the format's)."""
        j, t = self._read(i)
        return self._sample(i, j, t, final_state)

    def item(self, i: int) -> dict:
        """Item i (what `ds[i]` gives in the training process)."""
        j, t = self._read(i)
        return self._item(i, j, t)

    def __getitem__(self, i: int) -> dict:
        # in a DataLoader worker: a dict sent to the training process as one buffer (builder/reader/shipping.py)
        return _sent(self.item(i))

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """Items `indices` (what a DataLoader with a batch_size asks of each worker), each as `ds[i]` gives it, in
        the order asked: read together (`SegmentReader.read_many`: in the order they lie in the build, samples
        that lie one after another read at once, each checked against its own checksums). Where one cannot be
        read, they are read one by one in the order asked, and the first error raised is the one `ds[i]` raises."""
        n = len(self.index)
        try:
            pos = np.asarray([operator.index(i) for i in indices], dtype=np.int64)
        except TypeError:
            return [self[i] for i in indices]
        if n == 0 or not np.all((-n <= pos) & (pos < n)):
            return [self[i] for i in indices]  # (the IndexError ds[i] raises)
        pos %= n
        try:
            once = list(dict.fromkeys(pos.tolist()))  # (an entry asked twice: read once, its tensors copied)
            got = dict(zip(once, self._reader_here().read_many([self.index.location(j) for j in once]), strict=True))
            if not any(isinstance(t, Exception) for t in got.values()):
                out, seen = [], set()
                for i, j in zip(indices, pos.tolist(), strict=True):
                    t = got[j] if j not in seen else {f: v.clone() for f, v in got[j].items()}
                    seen.add(j)
                    out.append(_sent(self._item(i, j, t)))
                return out
        except Exception:  # noqa: BLE001 - (a location the log left NULL...): one by one, below
            pass
        return [self[i] for i in indices]  # a damaged sample: the error ds[i] raises first in the order asked

    def loader(self, batch_size: int | None = 1, *, items_per_message: int = ITEMS_PER_MESSAGE, **kwargs):
        """`DataLoader(self, batch_size, **kwargs)` (any of its arguments), whose workers send a group of
        consecutive items or batches a message (up to `items_per_message` items, about 1 MiB), read in storage
        order: it yields exactly what that DataLoader yields, item by item or batch by batch, in the same order
        (builder/reader/loader.py); `batch_size=None` reads one item at a time. With no workers it is that
        DataLoader."""
        info = self.info
        bytes_per_token = 16 + (1 + len(info.aux_layers)) * info.hidden_size * (4 if info.dtype == "float32" else 2)
        return make_loader(self, bytes_per_token, self.index.num_tokens, items_per_message, batch_size=batch_size,
                           **kwargs)

    def by_row(self) -> dict[int, int]:
        """Source row -> item index (the live samples only). A dict of every row: `index.position_of_row(row)`
        answers one without it."""
        return dict(zip(self.index.row_idx.tolist(), range(len(self.index)), strict=True))

    def by_id(self) -> dict[str, int]:
        return dict(zip(self.index.sample_ids(), range(len(self.index)), strict=True))


def _sent(item: dict) -> dict:
    """The item as it leaves this process: in a DataLoader worker, a `Shipped` dict (one buffer)."""
    return Shipped(item) if get_worker_info() is not None else item


def collate_concat(items: list[dict]) -> dict:
    """Pack a batch along the token axis (no padding), with cu_seqlens for varlen attention."""
    lens = torch.tensor([len(it["input_ids"]) for it in items])
    out = {k: torch.cat([it[k] for it in items]) for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")}
    out["cu_seqlens"] = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    out["sample_id"] = [it["sample_id"] for it in items]
    # in a DataLoader worker: sent to the training process as one buffer (builder/reader/shipping.py)
    return Shipped(out) if get_worker_info() is not None else out
