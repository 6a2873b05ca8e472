"""How arrays are encoded in a segment: codecs (Zarr v3 codecs, encoded with numcodecs), storage dtypes, checksums."""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c
import numcodecs
import numpy as np

from builder.config import CODEC_SPECS
from builder.errors import UsageError
from builder.store.dtypes import (
    STORAGE_DTYPES as STORAGE_DTYPES,  # re-exported: run/create.py imports it here
)
from builder.store.dtypes import torch_dtype

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is converted, not with this module: the run's coordinator, init and the CLI
# parse codecs without paying torch's start-up

# what numcodecs' Zstd (libzstd) accepts, negative levels being the fast modes; zarr's ZstdCodec stops at 22
ZSTD_LEVELS = (int(numcodecs.Zstd.min_level()), min(int(numcodecs.Zstd.max_level()), 22))
BLOSC_LEVELS = (0, 9)  # numcodecs' Blosc refuses any other clevel when it encodes (c-blosc's range)
# the opt-in lossy store (`init --quantize fp8`, config.QUANTIZE): a state field is stored as uint8 rows, each
# token's values as float8_e4m3fn bytes followed by its float32 scale (little-endian), as speculators' FP8
# connector quantizes
FP8_SCHEME = "fp8_e4m3fn_token_scale"  # the arrays' `quantized` attribute
SCALE_BYTES = 4


BLOSC_NAMES = {"blosc-lz4": ("lz4", "shuffle"), "blosc-zstd": ("zstd", "shuffle"),
               "blosc-lz4-bitshuffle": ("lz4", "bitshuffle"), "blosc-zstd-bitshuffle": ("zstd", "bitshuffle")}


def parse_codec(spec: str, typesize: int = 2) -> list:
    """`zstd:LEVEL`, `blosc-lz4:LEVEL`, `blosc-zstd:LEVEL` (byte shuffle), `blosc-lz4-bitshuffle:LEVEL`,
    `blosc-zstd-bitshuffle:LEVEL` (bit shuffle) or `none`, as the Zarr v3 codec documents that follow the
    `bytes` codec in an array's zarr.json (zarr_meta.py); `chunk_encoder` encodes with them.
    A level numcodecs would refuse (or silently clamp) is a UsageError naming --codec, so `init` refuses it
    instead of every sample failing later."""
    name, _, level_s = spec.partition(":")
    try:
        level = int(level_s) if level_s else None
    except ValueError:
        raise UsageError(f"--codec '{spec}': the level must be an integer, e.g. zstd:3") from None
    if name == "none":
        if level is not None:
            raise UsageError(f"--codec '{spec}': none takes no level; use none")
        return []
    if name == "zstd":
        if level is not None and not ZSTD_LEVELS[0] <= level <= ZSTD_LEVELS[1]:
            raise UsageError(f"--codec '{spec}': zstd levels are {ZSTD_LEVELS[0]}..{ZSTD_LEVELS[1]} "
                             "(1 is the default)")
        return [{"name": "zstd", "configuration": {"level": 1 if level is None else level, "checksum": False}}]
    if name in BLOSC_NAMES:
        if level is not None and not BLOSC_LEVELS[0] <= level <= BLOSC_LEVELS[1]:
            raise UsageError(f"--codec '{spec}': blosc levels are {BLOSC_LEVELS[0]}..{BLOSC_LEVELS[1]} "
                             "(5 is the default)")
        cname, shuffle = BLOSC_NAMES[name]
        return [{"name": "blosc", "configuration": {"typesize": typesize, "cname": cname,
                                                    "clevel": 5 if level is None else level, "shuffle": shuffle,
                                                    "blocksize": 0}}]
    raise UsageError(f"--codec '{spec}': use {CODEC_SPECS}")


def to_storage(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array stored in Zarr (bfloat16 as its raw uint16 bit patterns)."""
    import torch  # noqa: PLC0415

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, logical_dtype: str, quantized: str | None = None) -> torch.Tensor:
    """A stored array as a tensor in its logical dtype (bfloat16 bit-exact; FP8 rows dequantized)."""
    import torch  # noqa: PLC0415

    if quantized is not None:
        if quantized != FP8_SCHEME:
            raise ValueError(f"arrays quantized as '{quantized}': this hsbuild reads only {FP8_SCHEME}; upgrade it")
        return dequantize_fp8(a, torch_dtype(logical_dtype))
    if logical_dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def stored_width(width: int, quantize: str) -> int:
    """Values a token of a state field takes in its stored array: `width`, plus the scale's bytes for fp8."""
    return width + SCALE_BYTES if quantize == "fp8" else width


def quantize_fp8(t: torch.Tensor) -> np.ndarray:
    """[n, W] floats -> uint8 [n, W + 4]: each token's values as float8_e4m3fn bytes, then its float32 scale.
    The scale is the token's largest magnitude / 448 (at least 1e-12), computed exactly as speculators'
    `hs_connectors.fp8_utils.quantize_tensor_to_fp8` does over a token's values."""
    import torch  # noqa: PLC0415

    fp32 = t.detach().float()
    n, w = fp32.shape
    amax = fp32.abs().amax(dim=1, keepdim=True) if w else torch.zeros((n, 1))
    scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (fp32 / scale).to(torch.float8_e4m3fn)
    out = np.empty((n, w + SCALE_BYTES), dtype=np.uint8)
    out[:, :w] = q.view(torch.uint8).numpy()
    out[:, w:] = scale.numpy().astype("<f4").view(np.uint8).reshape(n, SCALE_BYTES)
    return out


def dequantize_fp8(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`quantize_fp8`'s rows back to [n, W] in `dtype`: fp8 values times their token's scale, both in `dtype`
    (as `hs_connectors.fp8_utils.dequantize_fp8_tensor` computes them)."""
    import torch  # noqa: PLC0415

    dtype = torch.bfloat16 if dtype is None else dtype
    w = a.shape[1] - SCALE_BYTES
    values = np.ascontiguousarray(a[:, :w])
    scale = torch.from_numpy(np.ascontiguousarray(a[:, w:]).view("<f4").astype(np.float32))
    if dtype == torch.bfloat16 and w % 2 == 0 and sys.byteorder == "little":
        # fp8 -> bf16 is exact: look the values up two at a time (6x torch's conversion on a CPU thread)
        pairs = np.take(_fp8_pairs_as_bf16(), values.view(np.uint16))
        q = torch.from_numpy(pairs.view(np.int16).reshape(values.shape)).view(torch.bfloat16)
    else:
        q = torch.from_numpy(values).view(torch.float8_e4m3fn).to(dtype)
    return q * scale.to(dtype)


@functools.cache
def _fp8_pairs_as_bf16() -> np.ndarray:
    """For every two fp8 bytes (read as one little-endian uint16), their bf16 bit patterns as one uint32."""
    import torch  # noqa: PLC0415

    one = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    lut = one.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    i = np.arange(1 << 16, dtype=np.uint32)
    return lut[i & 0xFF] | (lut[i >> 8] << 16)


def fp8_error(t: torch.Tensor, stored: np.ndarray, logical_dtype: str) -> float:
    """Relative RMS error of a state as `dequantize_fp8` reads it back: ||read - t|| / ||t|| (0 for all zeros)."""
    import torch  # noqa: PLC0415

    x = t.detach().float()
    norm = float(torch.linalg.vector_norm(x))
    if norm == 0.0:
        return 0.0
    diff = dequantize_fp8(stored, torch_dtype(logical_dtype)).float() - x
    return float(torch.linalg.vector_norm(diff)) / norm


def checksum(a: np.ndarray) -> str:
    return f"crc32c:{crc32c.crc32c(np.ascontiguousarray(a).data):08x}"


ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50  # ... to 0x184D2A5F: skippable frames (a 4-byte length, then that many bytes)
BLOSC_HEADER = struct.Struct("<4xI4xI")  # c-blosc 1's 16 bytes: ..., nbytes (uint32 LE), blocksize, cbytes
_U32 = struct.Struct("<I")
_ZSTD_FCS = {1: struct.Struct("<B"), 2: struct.Struct("<H"), 4: struct.Struct("<I"), 8: struct.Struct("<Q")}


def declared_size(codec: object, frame: bytes | memoryview) -> int | None:
    """How many bytes an encoded chunk says it decodes to, from its header alone (no decoding), or None when it
    does not say. blosc: the header's `nbytes`, the whole chunk's size (ValueError when the header's compressed
    size is not the chunk's length: c-blosc would read past the chunk's end). zstd: the frame content size of its
    first frame (after any skippable frames); None for a frame without one (streamed) or bytes that are no
    zstd frame. Readers decode straight into a chunk-sized buffer only when this equals its size: a codec
    asked to decode a shorter chunk into a bigger buffer fills its start and says nothing."""
    size = len(frame)  # bytes, or a memoryview of bytes (format B)
    if isinstance(codec, numcodecs.Blosc):
        nbytes, cbytes = BLOSC_HEADER.unpack_from(frame) if size >= BLOSC_HEADER.size else (0, -1)
        if cbytes != size:  # c-blosc trusts its header's compressed size and reads past a shorter buffer
            raise ValueError(f"a blosc chunk of {size} bytes whose header says {max(cbytes, 0)}")
        return nbytes
    if not isinstance(codec, numcodecs.Zstd):
        return None
    pos = 0
    while size - pos >= 8 and _U32.unpack_from(frame, pos)[0] & 0xFFFFFFF0 == ZSTD_SKIPPABLE:
        pos += 8 + _U32.unpack_from(frame, pos + 4)[0]
    if size - pos < 6 or _U32.unpack_from(frame, pos)[0] != ZSTD_MAGIC:
        return None
    fhd = frame[pos + 4]
    single = (fhd >> 5) & 1
    fcs_len = (single, 2, 4, 8)[fhd >> 6]
    if not fcs_len:
        return None
    at = pos + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if size < at + fcs_len:
        return None
    return _ZSTD_FCS[fcs_len].unpack_from(frame, at)[0] + (256 if fcs_len == 2 else 0)


def chunk_encoder(spec: str, typesize: int = 2) -> Callable[[np.ndarray], bytes]:
    """Encode one chunk (a C-contiguous little-endian array) exactly as zarr's `[bytes, <codec>]` pipeline for
    `spec` would, so zarr reads what hsbuild writes directly."""
    (codec,) = parse_codec(spec, typesize) or [None]
    if codec is None:
        return lambda a: a.tobytes()
    cfg = codec["configuration"]
    if codec["name"] == "zstd":
        z = numcodecs.Zstd(level=int(cfg["level"]), checksum=bool(cfg["checksum"]))
        return lambda a: bytes(z.encode(a))
    shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[str(cfg["shuffle"])]
    b = numcodecs.Blosc(cname=str(cfg["cname"]), clevel=int(cfg["clevel"]), shuffle=shuffle,
                        blocksize=int(cfg.get("blocksize", 0)), typesize=int(cfg["typesize"]))
    return lambda a: bytes(b.encode(a))
