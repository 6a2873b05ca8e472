"""How an item leaves a DataLoader worker: its tensors in one buffer, not one shared-memory segment each.

torch sends each tensor a worker returns through a shared-memory file of its own, whose descriptor the training
process fetches from the worker over a socket: a few hundred microseconds of the training process a tensor,
more than reading a small sample costs (tools/bench_reader.py). An item the dataset makes in a worker is a
`Shipped` dict: pickled (which is how the worker sends it), its tensors travel as one bytes buffer, copied, and
it arrives as a plain dict of plain tensors, each with its own storage, equal to what the worker held (dtype,
shape, values; contiguous). Tensors it cannot send so (not CPU, strided and contiguous, or needing grad) and
items above SHIP_BYTES (where one copy through shared memory is cheaper) go torch's way, unchanged.

A collate function that copies the item (`default_convert`, `default_collate`) keeps it a `Shipped` dict, and
`collate_concat` makes its batch one in a worker; a collate function that makes a dict of its own sends it
torch's way. A `ShippedList` (a group of items or batches, `HiddenStateDataset.loader`) carries every tensor of
its `Shipped` dicts in one buffer, up to SHIP_BYTES in all.
"""

from __future__ import annotations

import numpy as np
import torch

SHIP_BYTES = 1 << 20  # an item's tensors up to this many bytes travel as one buffer


def _shippable(v: object) -> bool:
    return (type(v) is torch.Tensor and v.device.type == "cpu" and v.layout == torch.strided
            and not v.requires_grad and v.is_contiguous() and not v.is_conj() and not v.is_neg())


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class Shipped(dict):
    """An item made in a DataLoader worker (builder/reader/shipping.py): a dict, pickled as one buffer."""

    __slots__ = ()

    def __copy__(self) -> Shipped:
        return Shipped(self)

    def __reduce__(self):
        packed = _pack([self])
        if packed is None:
            return dict, (), None, None, iter(self.items())  # torch's way
        (layout,), data = packed
        return _unship, (layout, data)


class ShippedList(list):
    """A list made in a DataLoader worker (builder/reader/loader.py: a group of items or batches): every tensor of
    its `Shipped` dicts in one buffer; it arrives as a plain list of plain dicts (its other elements pickled as
    they are)."""

    __slots__ = ()

    def __reduce__(self):
        packed = _pack(list(self))
        if packed is None:
            return list, (list(self),)  # each element its own way
        return _unship_list, packed


def _pack(values: list) -> tuple[list, bytearray] | None:
    """(each value's layout: a `Shipped` dict's, or None for a value pickled as it is; the buffer) or None where
    nothing is to be packed or the buffer would pass SHIP_BYTES."""
    plans = []
    for v in values:
        tensors = {k: t for k, t in v.items() if _shippable(t)} if type(v) is Shipped else {}
        plans.append(tensors)
    total = sum(t.nbytes for tensors in plans for t in tensors.values())
    if not any(plans) or total > SHIP_BYTES:
        return None
    data = bytearray(total)
    buf = np.frombuffer(data, dtype=np.uint8)
    layouts: list = []
    at = 0
    try:
        for v, tensors in zip(values, plans, strict=True):
            if not tensors:
                layouts.append((None, v))
                continue
            layout = []
            for k, t in v.items():
                if k in tensors:
                    n = t.nbytes
                    buf[at:at + n] = _bytes_of(t)
                    layout.append((k, t.dtype, tuple(t.shape), at))
                    at += n
                else:
                    layout.append((k, None, t, 0))  # pickled as it is (torch's way for a tensor)
            layouts.append(layout)
    except Exception:  # noqa: BLE001 - (a tensor whose bytes numpy cannot view): torch's way
        return None
    return layouts, data


def _unship(layout: list, data: bytearray) -> dict:
    """The plain dict of a `Shipped` item, in the training process."""
    src = np.frombuffer(data, dtype=np.uint8)
    out = {}
    for k, dtype, shape, at in layout:
        if dtype is None:
            out[k] = shape
            continue
        t = torch.empty(shape, dtype=dtype)
        _bytes_of(t)[:] = src[at:at + t.nbytes]
        out[k] = t
    return out


def _unship_list(layouts: list, data: bytearray) -> list:
    """The plain list of a `ShippedList`, in the training process."""
    out = []
    for layout in layouts:
        if isinstance(layout, tuple):  # (None, the value as it was pickled)
            out.append(layout[1])
        else:
            out.append(_unship(layout, data))
    return out
