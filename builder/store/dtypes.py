"""The one dtype table: what each dtype name the store meets (an array's Zarr `data_type`, a build's logical
dtype) is stored and read as. Every module that turns such a name into a storage type, a numpy or torch dtype
or an item size asks here.

torch is imported only when a torch dtype is asked for: `init`, the run's coordinator and the CLI use this table
without paying torch's start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# name -> (the Zarr data_type its values are stored as, the torch dtype they are read as). bfloat16 has no numpy
# type: it is stored as its raw uint16 bit patterns (the arrays' `logical_dtype` attribute says so)
DTYPES: dict[str, tuple[str, str]] = {
    "bfloat16": ("uint16", "bfloat16"),
    "float16": ("float16", "float16"),
    "float32": ("float32", "float32"),
    "int32": ("int32", "int32"),
    "int64": ("int64", "int64"),
    "uint8": ("uint8", "uint8"),
    "uint16": ("uint16", "uint16"),
}
STATE_DTYPES = ("bfloat16", "float16", "float32")  # what a build may store its states as (`init --dtype`)
STORAGE_DTYPES = {name: DTYPES[name][0] for name in STATE_DTYPES}  # {state dtype: its Zarr data_type}


def numpy_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype of values stored as `name` (a name the table lacks: as numpy reads it)."""
    return np.dtype(DTYPES[name][0] if name in DTYPES else name).newbyteorder("<")


def itemsize(name: str, default: int | None = None) -> int:
    """Bytes a value of `name` takes stored; a name the table lacks: `default`, or KeyError without one."""
    if name not in DTYPES and default is not None:
        return default
    return np.dtype(DTYPES[name][0]).itemsize


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype values of `name` are read as (bfloat16 for bfloat16: bit-exact)."""
    import torch  # noqa: PLC0415

    return getattr(torch, DTYPES[name][1])
