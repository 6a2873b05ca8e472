"""How arrays are encoded in a segment: codecs (zarr's, backed by numcodecs), storage dtypes, checksums."""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import numcodecs
import numpy as np
import torch
import zarr.codecs as zc

from builder.config import CODEC_SPECS
from builder.errors import UsageError

# what numcodecs' Zstd (libzstd) accepts, negative levels being the fast modes; zarr's ZstdCodec stops at 22
ZSTD_LEVELS = (int(numcodecs.Zstd.min_level()), min(int(numcodecs.Zstd.max_level()), 22))
BLOSC_LEVELS = (0, 9)  # numcodecs' Blosc refuses any other clevel when it encodes (c-blosc's range)
STORAGE_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}


BLOSC_NAMES = {"blosc-lz4": ("lz4", "shuffle"), "blosc-zstd": ("zstd", "shuffle"),
               "blosc-lz4-bitshuffle": ("lz4", "bitshuffle"), "blosc-zstd-bitshuffle": ("zstd", "bitshuffle")}


def parse_codec(spec: str) -> list:
    """`zstd:LEVEL`, `blosc-lz4:LEVEL`, `blosc-zstd:LEVEL` (byte shuffle), `blosc-lz4-bitshuffle:LEVEL`,
    `blosc-zstd-bitshuffle:LEVEL` (bit shuffle) or `none` (zarr's codecs, backed by numcodecs).
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
        return [zc.ZstdCodec(level=1 if level is None else level)]
    if name in BLOSC_NAMES:
        if level is not None and not BLOSC_LEVELS[0] <= level <= BLOSC_LEVELS[1]:
            raise UsageError(f"--codec '{spec}': blosc levels are {BLOSC_LEVELS[0]}..{BLOSC_LEVELS[1]} "
                             "(5 is the default)")
        cname, shuffle = BLOSC_NAMES[name]
        return [zc.BloscCodec(cname=cname, clevel=5 if level is None else level, shuffle=shuffle, typesize=2)]
    raise UsageError(f"--codec '{spec}': use {CODEC_SPECS}")


def to_storage(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array stored in Zarr (bfloat16 as its raw uint16 bit patterns)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, logical_dtype: str) -> torch.Tensor:
    if logical_dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def checksum(a: np.ndarray) -> str:
    return f"crc32c:{crc32c.crc32c(np.ascontiguousarray(a).data):08x}"


def chunk_encoder(spec: str) -> Callable[[np.ndarray], bytes]:
    """Encode one chunk (a C-contiguous little-endian array) exactly as zarr's `[bytes, <codec>]` pipeline for
    `spec` would, so zarr reads what hsbuild writes directly."""
    (codec,) = parse_codec(spec) or [None]
    if codec is None:
        return lambda a: a.tobytes()
    if isinstance(codec, zc.ZstdCodec):
        z = numcodecs.Zstd(level=codec.level, checksum=codec.checksum)
        return lambda a: bytes(z.encode(a))
    cfg = codec.to_dict()["configuration"]
    shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[str(cfg["shuffle"])]
    b = numcodecs.Blosc(cname=str(cfg["cname"]), clevel=int(cfg["clevel"]), shuffle=shuffle,
                        blocksize=int(cfg.get("blocksize", 0)), typesize=int(cfg["typesize"]))
    return lambda a: bytes(b.encode(a))
