"""`HiddenStateDataset.loader`: a DataLoader whose workers send several items (or batches) a message.

torch sends each item (with `batch_size=None`) or each batch from a worker to the training process as one message,
and each costs both processes a fixed amount of CPU (the index sent, the result pickled by a feeder thread, piped,
received, unpickled: about 0.45 ms in all here) whatever its size: more than reading a small sample (0.3-0.4 ms,
tools/bench_reader.py), so on a few cores two workers reading one item at a time read about what none read. The
loader makes the same DataLoader (`DataLoader(dataset, **kwargs)`: its sampler, batches, collate function, seed and
generator draws) and has its workers read a group of consecutive items or batches a message (up to
ITEMS_PER_MESSAGE items and about SHIP_BYTES of tensors, estimated from the samples' token counts), in the order
they lie in the build, collate each batch as the DataLoader would, and send the group as one buffer
(builder/reader/shipping.py); the training process unpacks each group and yields its items or batches one at a
time: the same values, in the same order, as the DataLoader with no workers gives.

A sample that cannot be read raises its error where the DataLoader would (as torch raises a worker's error: the
items or batches before it yielded first, the iteration able to go on after it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.worker import ExceptionWrapper, get_worker_info

from builder.reader.shipping import SHIP_BYTES, ShippedList

ITEMS_PER_MESSAGE = 32  # a group's items at most (batches of more travel one a message, as torch sends them)

# DataLoader arguments that only decide how the loader runs (passed on as they are); the others decide what it yields
RUNNING = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "prefetch_factor",
           "persistent_workers", "pin_memory_device", "in_order")


class _Groups(Sampler):
    """The inner DataLoader's batch sampler: consecutive entries of the DataLoader's own index sampler (indices, or
    batches of indices), grouped. Iterated lazily, as torch iterates the one it replaces (so a shuffling sampler
    draws its seed from the same generator at the same moment)."""

    def __init__(self, index_sampler, sizes: np.ndarray, bytes_per_token: int, max_items: int):
        self.index_sampler, self.sizes, self.bytes_per_token, self.max_items = (index_sampler, sizes,
                                                                                bytes_per_token, max_items)

    def _nbytes(self, entry) -> int:
        """The entry's estimated bytes (0 for an index that is not one of the dataset's: it is the worker that
        raises the IndexError the DataLoader would)."""
        try:
            pos = np.asarray(entry if isinstance(entry, list | tuple) else [entry], dtype=np.int64)
            n = len(self.sizes)
            if not np.all((-n <= pos) & (pos < n)):
                return 0
            return int(np.maximum(self.sizes[pos], 0).sum()) * self.bytes_per_token
        except (TypeError, ValueError, OverflowError):
            return 0

    def __iter__(self) -> Iterator[list]:
        group: list = []
        items = nbytes = 0
        for entry in self.index_sampler:
            size = len(entry) if isinstance(entry, list | tuple) else 1
            cost = self._nbytes(entry)
            if group and (items + size > self.max_items or nbytes + cost > SHIP_BYTES):
                yield group
                group, items, nbytes = [], 0, 0
            group.append(entry)
            items += size
            nbytes += cost
        if group:
            yield group


class _Grouped(Dataset):
    """What the inner DataLoader's workers read: a group of the DataLoader's entries, as a list of what the
    DataLoader's worker would send for each (its item, or its collated batch)."""

    def __init__(self, dataset, collate_fn, batched: bool):
        self.dataset, self.collate_fn, self.batched = dataset, collate_fn, batched

    def __len__(self) -> int:
        return len(self.dataset)

    def _one(self, entry):
        if self.batched:
            return self.collate_fn(self.dataset.__getitems__(list(entry)))
        return self.collate_fn(self.dataset[entry])

    def __getitems__(self, group: list) -> list:
        try:  # every item of the group read at once, in the order the samples lie in the build
            flat = [i for entry in group for i in entry] if self.batched else list(group)
            items = self.dataset.__getitems__(flat)
        except Exception:  # noqa: BLE001 - entry by entry below: the error where the DataLoader meets it
            return self._each(group)
        out, at = [], 0
        try:
            for entry in group:
                if self.batched:
                    out.append(self.collate_fn(items[at:at + len(entry)]))
                    at += len(entry)
                else:
                    out.append(self.collate_fn(items[at]))
                    at += 1
        except Exception:  # noqa: BLE001 - (a collate function's error): entry by entry
            return self._each(group)
        return out

    def _each(self, group: list) -> list:
        out: list = []
        for entry in group:
            try:
                out.append(self._one(entry))
            except Exception:  # noqa: BLE001 - sent to the training process, raised in its place
                info = get_worker_info()
                out.append(ExceptionWrapper(where=f"in DataLoader worker process {info.id if info else 0}"))
        return out


def _send(group: list) -> list:
    """The inner DataLoader's collate function: the group, to travel as one buffer."""
    return ShippedList(group) if get_worker_info() is not None else group


class GroupedLoader:
    """What `HiddenStateDataset.loader` returns where there are workers: iterated, exactly what `self.plain` (the
    DataLoader of the same arguments) yields; its workers send `self.inner`'s groups."""

    def __init__(self, plain: DataLoader, inner: DataLoader):
        self.plain, self.inner = plain, inner
        self.dataset, self.batch_size, self.num_workers = plain.dataset, plain.batch_size, plain.num_workers
        self.sampler, self.batch_sampler, self.collate_fn = plain.sampler, plain.batch_sampler, plain.collate_fn
        self.generator, self.drop_last = plain.generator, plain.drop_last

    def __len__(self) -> int:
        return len(self.plain)

    def __iter__(self) -> _Ungrouped:
        return _Ungrouped(iter(self.inner))


class _Ungrouped:
    """The groups' entries one at a time. An entry that failed raises its error in its place, and the next one is
    yielded after it, as a DataLoader's iterator goes on after a worker's error."""

    def __init__(self, groups: Iterator[list]):
        self.groups, self.pending = groups, deque()

    def __iter__(self) -> _Ungrouped:
        return self

    def __next__(self):
        while not self.pending:
            self.pending.extend(next(self.groups))
        x = self.pending.popleft()
        if isinstance(x, ExceptionWrapper):
            x.reraise()
        return x


def make_loader(dataset, bytes_per_token: int, sizes: np.ndarray, items_per_message: int = ITEMS_PER_MESSAGE,
                **kwargs) -> DataLoader | GroupedLoader:
    """`DataLoader(dataset, **kwargs)`, its workers sending groups (the module's doc); with no workers (or
    `items_per_message=1`) that DataLoader itself."""
    plain = DataLoader(dataset, **kwargs)
    if plain.num_workers == 0 or items_per_message <= 1:
        return plain
    running = {k: kwargs[k] for k in RUNNING if k in kwargs}
    inner = DataLoader(_Grouped(dataset, plain.collate_fn, plain._auto_collation),
                       batch_sampler=_Groups(plain._index_sampler, sizes, bytes_per_token, items_per_message),
                       collate_fn=_send, generator=plain.generator, **running)
    return GroupedLoader(plain, inner)
