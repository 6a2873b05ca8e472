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

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numcodecs
import numpy as np

from builder.errors import DamagedSampleError
from builder.store.codec import declared_size
from builder.store.shard import CRC_BYTES, EMPTY, INDEX_ENTRY, ShardIndexError, decode_index, shard_path

MISSING, UNREADABLE = "missing_data", "unreadable"
GONE = (2, 20)  # ENOENT, ENOTDIR
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
        meta = json.loads((seg_dir / fld / "zarr.json").read_bytes())
        codecs = meta.get("codecs") or []
        if not codecs or codecs[0].get("name") != "sharding_indexed":
            return None
        cfg = codecs[0]["configuration"]
        inner_codecs = cfg.get("codecs") or []
        if cfg.get("index_location", "end") != "end" or not inner_codecs or inner_codecs[0].get("name") != "bytes":
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
        shape = meta["shape"]
        inner = int(cfg["chunk_shape"][0])
        outer = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        attrs = meta.get("attributes") or {}
        return cls(inner, outer // inner, np.dtype(meta["data_type"]).newbyteorder("<"),
                   int(shape[1]) if len(shape) == 2 else 0, codec, len(shape), attrs.get("logical_dtype"),
                   attrs.get("quantized"))


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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            if e.errno not in GONE:
                raise
            problem = "the segment directory is gone" if not seg_dir.is_dir() else f"shard file {rel} is missing"
            raise DamagedSampleError(MISSING, problem, segment=segment, field=fld) from e
        try:
            rows = _index_rows(fd, rel, segment, fld, sc, lo - s * sc, hi - s * sc, s * sc)
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
                buf = _pread(fd, end - start, start, rel, segment, fld)
                parts = [(memoryview(buf)[int(r[0]) - start : int(r[0] + r[1]) - start], dst[k])
                         for k, r in enumerate(rows)]
            else:
                parts = [(_pread(fd, int(r[1]), int(r[0]), rel, segment, fld), dst[k]) for k, r in enumerate(rows)]
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


def _index_rows(fd: int, rel: Path, segment: str, fld: str, shard_chunks: int, lo: int, hi: int,
                base: int) -> np.ndarray:
    size = os.fstat(fd).st_size
    want = shard_chunks * INDEX_ENTRY + CRC_BYTES
    if size == 0:
        raise DamagedSampleError(UNREADABLE, f"shard file {rel} is empty", segment=segment, field=fld)
    try:
        if size < want:
            raise ShardIndexError(f"file is {size} bytes, shorter than its index ({want})")
        idx = decode_index(os.pread(fd, want, size - want), shard_chunks)
        present = idx[:, 0] != EMPTY
        end = int((idx[present, 0] + idx[present, 1]).max()) if present.any() else 0
        if end != size - want:
            raise ShardIndexError(f"holds {size - want} bytes of chunk data, its index accounts for {end} "
                                  "(truncated, appended to or rewritten)")
    except ShardIndexError as e:
        raise DamagedSampleError(UNREADABLE, f"shard file {rel}: {e}", segment=segment, field=fld) from e
    rows = idx[lo : hi + 1]
    absent = rows[:, 0] == EMPTY
    if absent.any():
        k = base + lo + int(np.argmax(absent))
        raise DamagedSampleError(MISSING, f"shard file {rel} lacks chunk {k} of the sample", segment=segment,
                                 field=fld)
    return rows


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
