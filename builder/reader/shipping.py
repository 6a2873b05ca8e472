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
torch's way.
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
        plain = (dict, (), None, None, iter(self.items()))  # torch's way
        tensors = {k: v for k, v in self.items() if _shippable(v)}
        total = sum(v.nbytes for v in tensors.values())
        if not tensors or total > SHIP_BYTES:
            return plain
        data = bytearray(total)
        buf = np.frombuffer(data, dtype=np.uint8)
        layout, at = [], 0
        try:
            for k, v in self.items():
                if k in tensors:
                    n = v.nbytes
                    buf[at:at + n] = _bytes_of(v)
                    layout.append((k, v.dtype, tuple(v.shape), at))
                    at += n
                else:
                    layout.append((k, None, v, 0))  # pickled as it is (torch's way for a tensor)
        except Exception:  # noqa: BLE001 - (a tensor whose bytes numpy cannot view): torch's way
            return plain
        return _unship, (layout, data)


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
