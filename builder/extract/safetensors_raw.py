"""The safetensors format read and written without torch: one tensor's raw bytes out of a checkpoint, and a
small file of raw tensors (the build's `final_norm.safetensors`). Format: an 8-byte little-endian header size,
a JSON header (`{name: {dtype, shape, data_offsets}}`, `__metadata__`: str -> str), padded with spaces to a
multiple of 8, then the data. torch's own reader (`safetensors.safe_open`) reads what `write_raw` writes."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from builder.fsutil import atomic_write_bytes

# build dtypes (hsbuild's --dtype) as safetensors spells them
DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MAX_HEADER = 100 << 20  # as the safetensors library: a larger header is a damaged file


@dataclass(frozen=True)
class RawTensor:
    dtype: str  # safetensors' code: BF16, F16, F32, ...
    shape: tuple[int, ...]
    data: bytes


def read_header(path: Path) -> tuple[dict, int]:
    """(the header, where the data starts). ValueError for a file that is not safetensors."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ValueError(f"{path}: header of {size} bytes; not a safetensors file")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        raise ValueError(f"{path}: header is not JSON; not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object; not a safetensors file")
    return header, 8 + size


def read_raw(path: Path, key: str) -> RawTensor | None:
    """One tensor's raw bytes (None if the file has no such tensor); only its bytes are read."""
    header, start = read_header(path)
    info = header.get(key)
    if not isinstance(info, dict):
        return None
    a, b = (int(x) for x in info["data_offsets"])
    with open(path, "rb") as f:
        f.seek(start + a)
        data = f.read(b - a)
    if len(data) != b - a:
        raise ValueError(f"{path}: tensor {key} is cut short")
    return RawTensor(str(info["dtype"]), tuple(int(x) for x in info["shape"]), data)


def encode_raw(tensors: dict[str, RawTensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(t.data for t in tensors.values())


def write_raw(path: Path, tensors: dict[str, RawTensor], metadata: dict[str, str] | None = None) -> None:
    """Written atomically (temp file, fsync, rename)."""
    atomic_write_bytes(path, encode_raw(tensors, metadata))
