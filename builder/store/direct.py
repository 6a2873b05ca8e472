"""Reading a sample's tokens straight from its shard files, without going through Zarr's read path.

hsbuild writes the shards itself (`store.shard`), so it can read them the same way: for each shard holding part
of the sample, one `pread` of the index (checked: its CRC-32C, and that it accounts for exactly the file's chunk
bytes), one `pread` of the sample's inner chunks (they lie one after another), and each chunk decoded straight
into its place in one preallocated array. With `codec none` a sample within one shard is not copied at all: the
array is a view of a private mapping of the write-once shard file (as `torch.load(mmap=True)` gives), its
CRC-32C checked when read; a sample across shards is read straight into one array. Zarr's path reads each shard
index twice, copies every chunk into new bytes, then into a per-shard buffer, then into the output, through an
event loop; this is the same bytes with one copy and no event loop (tools/bench_read.py measures both).

Every way a file can be missing or damaged raises DamagedSampleError with the reasons the rest of the store uses
(`missing_data`, `unreadable`); an OSError that says nothing about the data (EMFILE, EIO) propagates. A chunk
that decodes to anything but exactly its chunk's bytes is `unreadable`, checksums compared or not: the output
is never left partly unwritten (`np.empty`'s leftovers).
Only layout-2 (sharded) fields whose codec is one hsbuild writes are read here (`FieldLayout.of` returns None
otherwise, and the caller falls back to Zarr).
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numcodecs
import numpy as np

from builder.errors import DamagedSampleError
from builder.store.codec import declared_size
from builder.store.damage import UNREADABLE, needed, shard_rows
from builder.store.shard import shard_path
from builder.store.zarr_meta import ArrayMeta, read_array_meta

PARALLEL_BYTES = 4 << 20  # decode a sample's chunks on several threads above this many compressed bytes
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="hsbuild-read")
    return _POOL


@dataclass(frozen=True)
class FieldLayout:
    inner: int  # tokens per inner chunk
    shard_chunks: int  # inner chunks per shard file
    dtype: np.dtype
    width: int  # 0: one value per token (input_ids, loss_mask); else values per token
    codec: object | None  # a numcodecs codec with decode(buf, out=), or None for raw bytes
    dims: int
    logical: str | None  # the logical dtype when it differs from the stored one (bfloat16 stored as uint16)
    quantized: str | None = None  # how the values were quantized (codec.FP8_SCHEME), None: stored exactly

    @classmethod
    def of(cls, seg_dir: Path, fld: str) -> FieldLayout | None:
        return cls.from_meta(read_array_meta(seg_dir / fld))

    @classmethod
    def from_meta(cls, meta: ArrayMeta) -> FieldLayout | None:
        """The layout of a sharded field, its index at the end, little-endian, raw or one hsbuild codec; None when
        hsbuild does not read it directly (Zarr does)."""
        inner_codecs = meta.codecs
        if not meta.shard_chunks or meta.index_location != "end" or not inner_codecs \
                or inner_codecs[0].get("name") != "bytes":
            return None
        if (inner_codecs[0].get("configuration") or {}).get("endian", "little") != "little":
            return None
        rest = inner_codecs[1:]
        if len(rest) > 1:
            return None
        codec = None
        if rest:
            c = rest[0]
            conf = c.get("configuration") or {}
            if c.get("name") == "zstd":
                codec = numcodecs.Zstd(level=int(conf.get("level", 1)), checksum=bool(conf.get("checksum", False)))
            elif c.get("name") == "blosc":
                codec = numcodecs.Blosc(cname=str(conf.get("cname", "lz4")))  # decoding reads its header
            else:
                return None
        shape = meta.shape
        return cls(meta.chunk_tokens, meta.shard_chunks, meta.dtype, int(shape[1]) if len(shape) == 2 else 0, codec,
                   len(shape), meta.logical_dtype, meta.quantized)


def read_field(seg_dir: Path, segment: str, fld: str, lay: FieldLayout, token_start: int,
               num_tokens: int) -> np.ndarray:
    """The field's values for tokens [token_start, token_start + num_tokens)."""
    c, sc = lay.inner, lay.shard_chunks
    first_chunk = token_start // c
    last_chunk = (token_start + max(num_tokens, 1) - 1) // c
    n_chunks = last_chunk - first_chunk + 1
    row = (lay.width,) if lay.width else ()
    out = np.empty((n_chunks * c, *row), dtype=lay.dtype)
    flat = out.reshape(n_chunks, -1)  # one row per chunk, C-contiguous
    chunk_bytes = flat.shape[1] * lay.dtype.itemsize
    jobs = []
    for s in range(first_chunk // sc, last_chunk // sc + 1):
        lo, hi = max(first_chunk, s * sc), min(last_chunk, (s + 1) * sc - 1)
        path = shard_path(seg_dir, fld, lay.dims, s)
        rel = path.relative_to(seg_dir)
        with needed(seg_dir, path, segment, fld, "shard file"):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            rows = shard_rows(fd, rel, segment, fld, s, sc, lo - s * sc, hi - s * sc)
            start, end = int(rows[0, 0]), int(rows[-1, 0] + rows[-1, 1])
            if np.any(rows[1:, 0] != rows[:-1, 0] + rows[:-1, 1]):
                start = end = -1  # not one after another (never written so): read chunk by chunk
            dst = flat[lo - first_chunk : hi - first_chunk + 1]
            if lay.codec is None:
                if np.any(rows[:, 1] != chunk_bytes):
                    raise DamagedSampleError(UNREADABLE, f"shard file {rel}: a chunk is not {chunk_bytes} bytes "
                                                         "long", segment=segment, field=fld)
                if start >= 0 and lo == first_chunk and hi == last_chunk:  # one shard: map it, copy nothing
                    # a private (copy-on-write) mapping: writable for torch, never written back
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                    whole = np.frombuffer(mm, dtype=lay.dtype, count=n_chunks * flat.shape[1], offset=start)
                    skip = token_start - first_chunk * c
                    return whole.reshape(n_chunks * c, *row)[skip : skip + num_tokens]
                if start >= 0:
                    _pread_into(fd, memoryview(dst).cast("B"), start, rel, segment, fld)
                else:
                    for k in range(rows.shape[0]):
                        _pread_into(fd, memoryview(dst[k]).cast("B"), int(rows[k, 0]), rel, segment, fld)
                continue
            if start >= 0:
                view = memoryview(_pread(fd, end - start, start, rel, segment, fld))
                parts = [(view[o - start : o + n - start], dst[k]) for k, (o, n) in enumerate(rows.tolist())]
            else:
                parts = [(_pread(fd, n, o, rel, segment, fld), dst[k]) for k, (o, n) in enumerate(rows.tolist())]
            jobs += [(p, d, rel) for p, d in parts]
        finally:
            os.close(fd)
    if jobs:
        total = sum(len(p) for p, _, _ in jobs)
        run = _pool().map if total >= PARALLEL_BYTES and len(jobs) > 1 else map
        for err in run(lambda j: _decode(lay.codec, *j, segment, fld), jobs):
            if err is not None:
                raise err
    skip = token_start - first_chunk * c
    return out[skip : skip + num_tokens]


def _pread(fd: int, n: int, offset: int, rel: Path, segment: str, fld: str) -> bytes:
    buf = os.pread(fd, n, offset)
    if len(buf) != n:
        raise DamagedSampleError(UNREADABLE, f"shard file {rel}: read {len(buf)} of {n} bytes", segment=segment,
                                 field=fld)
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, rel: Path, segment: str, fld: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise DamagedSampleError(UNREADABLE, f"shard file {rel}: read {done} of {len(view)} bytes",
                                     segment=segment, field=fld)
        done += got


def _decode(codec, src, dst: np.ndarray, rel: Path, segment: str, fld: str) -> DamagedSampleError | None:
    """Decode one chunk into `dst` (its row of the output), which it must fill exactly. A codec asked to decode
    a shorter chunk into a bigger buffer fills its start and says nothing (numcodecs' zstd and blosc both), so
    the chunk is decoded in place only when its header says it is exactly `dst`'s size (the decoder then
    refuses anything longer, and zstd and blosc check that the frame produces what its header says); a chunk
    that says nothing (a streamed zstd frame, frames one after another) is decoded into a buffer of its own
    and its size compared. A wrong size is damage, whether or not checksums are compared afterwards."""
    want = dst.nbytes
    try:
        said = declared_size(codec, src)
        if said == want:
            codec.decode(src, out=dst)
            return None
        if said is not None and (isinstance(codec, numcodecs.Blosc) or said > want):
            got = said  # one blosc chunk says its whole size; a first zstd frame longer than the chunk: too long
        else:
            out = np.frombuffer(codec.decode(src), dtype=np.uint8)
            got = out.size
            if got == want:
                dst.reshape(-1).view(np.uint8)[:] = out
                return None
    except (MemoryError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - bytes present but not a chunk of this codec and size
        return DamagedSampleError(UNREADABLE, f"shard file {rel}: chunk files do not decode ({type(e).__name__}: "
                                              f"{str(e)[:200]})", segment=segment, field=fld)
    return DamagedSampleError(UNREADABLE, f"shard file {rel}: a chunk decodes to {got} bytes, not the {want} of "
                                          "a chunk of this field (a short or foreign frame)", segment=segment,
                              field=fld)
