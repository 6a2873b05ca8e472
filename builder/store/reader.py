"""Reading samples back from segments, by location."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import zarr

from builder.store.codec import from_storage
from builder.store.segment import FIELDS


class SegmentReader:
    """Reads samples back by location. Keeps opened arrays per segment."""

    def __init__(self, data_root: Path):
        self.data_root = Path(data_root)
        self._cache: dict[str, dict] = {}

    def arrays(self, segment: str) -> dict:
        if segment not in self._cache:
            group = zarr.open_group(store=str(self.data_root / segment), mode="r")
            self._cache[segment] = {f: group[f] for f in FIELDS}
        return self._cache[segment]

    def read_raw(self, segment: str, token_start: int, num_tokens: int) -> dict[str, np.ndarray]:
        arrs = self.arrays(segment)
        return {f: arrs[f][token_start : token_start + num_tokens] for f in FIELDS}

    def read(self, segment: str, token_start: int, num_tokens: int) -> dict[str, torch.Tensor]:
        raw = self.read_raw(segment, token_start, num_tokens)
        out = {}
        for f, a in raw.items():
            logical = self.arrays(segment)[f].attrs.get("logical_dtype")
            out[f] = from_storage(a, logical) if logical else torch.from_numpy(np.ascontiguousarray(a))
        return out
