"""The data: a Zarr v3 group of write-once segments, ragged along the token axis.

    data/                      Zarr v3 group (layout attributes)
      seg-<run>-w<k>-<rand>/   one segment per writer start; only that writer ever writes into it
        input_ids              int32   [T]
        loss_mask              uint8   [T]
        hidden_state           uint16  [T, H]        raw bfloat16 bit patterns (attribute logical_dtype)
        aux_hidden_state       uint16  [T, n_aux*H]
        seal.json              written (atomically) when the writer stops cleanly

Every sample starts on a chunk boundary, so each chunk file belongs to exactly one sample and is written once,
whole, and never touched again. Arrays are created with a fixed, very large shape, so no metadata is rewritten
while writing. See docs/design.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numcodecs
import numpy as np
import torch
import zarr

from builder.fsutil import atomic_write_bytes, fsync_path, fsync_paths
from builder.store.codec import STORAGE_DTYPES, checksum, parse_codec, to_storage

FIELDS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
SEGMENT_CAPACITY = 1 << 36  # tokens; arrays never resize
LAYOUT_VERSION = 1
SEAL_NAME = "seal.json"


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(4, min(16, 2 * (os.cpu_count() or 1))),
                                   thread_name_prefix="hsbuild-chunk")
    return _POOL


@dataclass
class Location:
    segment: str
    token_start: int
    num_tokens: int
    nbytes: int
    checksums: dict[str, str]


def init_data_group(data_root: Path, attrs: dict) -> None:
    zarr.create_group(store=str(data_root), zarr_format=3, attributes={"hsbuild_layout": LAYOUT_VERSION, **attrs},
                      overwrite=False)
    fsync_path(data_root)
    fsync_path(data_root.parent)


def chunk_paths(seg_dir: Path, fld: str, token_start: int, num_tokens: int, chunk_tokens: int) -> list[Path]:
    """The chunk files holding tokens [token_start, token_start+num_tokens) of one field."""
    first = token_start // chunk_tokens
    last = (token_start + max(num_tokens, 1) - 1) // chunk_tokens
    base = seg_dir / fld / "c"
    if fld in ("input_ids", "loss_mask"):
        return [base / str(i) for i in range(first, last + 1)]
    return [base / str(i) / "0" for i in range(first, last + 1)]


def new_segment_name(run_id: str, worker: int) -> str:
    return f"seg-{run_id[:8]}-w{worker:02d}-{uuid.uuid4().hex[:6]}"


@dataclass
class SegmentWriter:
    """The only writer of one segment. Appends samples at chunk-aligned offsets; each write is durable on return."""

    data_root: Path
    name: str
    hidden_size: int
    n_aux: int
    chunk_tokens: int
    codec: str = "zstd:1"
    dtype: str = "bfloat16"
    cursor: int = 0
    samples: int = 0
    _arrays: dict = field(default_factory=dict)
    _zstd: object = None

    @property
    def path(self) -> Path:
        return self.data_root / self.name

    def create(self) -> SegmentWriter:
        """Create the segment (directory and Zarr metadata, fsynced). If that fails (a full disk), what was
        created of it is removed again: the directory is this writer's alone and holds no sample yet."""
        self.path.mkdir()  # exclusive: a segment name is never reused
        try:
            self._create_arrays()
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            self._arrays.clear()
            raise
        return self

    def _create_arrays(self) -> None:
        compressors = parse_codec(self.codec)
        group = zarr.create_group(store=str(self.path), zarr_format=3,
                                  attributes={"segment": self.name, "created_at": time.time()})
        store_dtype = STORAGE_DTYPES[self.dtype]
        specs = {
            "input_ids": ((SEGMENT_CAPACITY,), (self.chunk_tokens,), "int32", {}),
            "loss_mask": ((SEGMENT_CAPACITY,), (self.chunk_tokens,), "uint8", {}),
            "hidden_state": ((SEGMENT_CAPACITY, self.hidden_size), (self.chunk_tokens, self.hidden_size), store_dtype,
                             {"logical_dtype": self.dtype}),
            "aux_hidden_state": ((SEGMENT_CAPACITY, self.n_aux * self.hidden_size),
                                 (self.chunk_tokens, self.n_aux * self.hidden_size), store_dtype,
                                 {"logical_dtype": self.dtype}),
        }
        for fld, (shape, chunks, dtype, attrs) in specs.items():
            self._arrays[fld] = group.create_array(
                name=fld, shape=shape, chunks=chunks, dtype=dtype, compressors=compressors, fill_value=0,
                attributes=attrs, config={"write_empty_chunks": True},
            )
        fsync_paths([self.path / f / "zarr.json" for f in FIELDS] + [self.path / f for f in FIELDS]
                    + [self.path / "zarr.json", self.path, self.data_root])

    def write(self, input_ids: np.ndarray, loss_mask: np.ndarray, aux: torch.Tensor, final: torch.Tensor) -> Location:
        """Write one sample whole and make it durable (chunk files and their directories fsynced)."""
        n = int(input_ids.shape[0])
        start = self.cursor
        arrays = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int32),
            "loss_mask": np.ascontiguousarray(loss_mask, dtype=np.uint8),
            "hidden_state": to_storage(final),
            "aux_hidden_state": to_storage(aux),
        }
        # The cursor moves past this range before writing: if the write fails (full disk), the range is
        # abandoned, never reused.
        self.cursor = -(-(start + n) // self.chunk_tokens) * self.chunk_tokens
        if self._encoder is not None:
            nbytes = self._write_direct(start, arrays)
        else:
            nbytes = self._write_zarr(start, arrays)
        self.samples += 1
        return Location(self.name, start, n, nbytes, {f: checksum(a) for f, a in arrays.items()})

    @property
    def _encoder(self):
        """The chunk encoder for direct writes (zstd or no compression); None: write through zarr (blosc)."""
        name, _, level = self.codec.partition(":")
        if name == "none":
            return lambda raw: raw
        if name == "zstd":
            if self._zstd is None:
                self._zstd = numcodecs.Zstd(level=int(level) if level else 1, checksum=False)
            return self._zstd.encode
        return None

    def _write_direct(self, start: int, arrays: dict[str, np.ndarray]) -> int:
        """Encode each chunk exactly as zarr's codec pipeline does ([bytes(little), zstd]), and write it once
        (O_EXCL: a chunk file is never overwritten), fsynced, in parallel threads (the codecs drop the GIL)."""
        c = self.chunk_tokens
        encode = self._encoder
        jobs: list[tuple[Path, np.ndarray]] = []
        dirs: list[Path] = []
        for fld, a in arrays.items():
            n = a.shape[0]
            paths = chunk_paths(self.path, fld, start, n, c)
            for k, p in enumerate(paths):
                part = a[k * c : (k + 1) * c]
                if part.shape[0] < c:  # the sample's last chunk: zero padding (the fill value) to full shape
                    full = np.zeros((c, *a.shape[1:]), dtype=a.dtype)
                    full[: part.shape[0]] = part
                    part = full
                jobs.append((p, part))
                if p.parent.name != "c":
                    dirs.append(p.parent)
                dirs.append(self.path / fld / "c")
            dirs.append(self.path / fld)
        for d in dict.fromkeys(reversed(dirs)):
            d.mkdir(exist_ok=True)

        def put(job: tuple[Path, np.ndarray]) -> int:
            path, chunk = job
            data = encode(np.ascontiguousarray(chunk, dtype=chunk.dtype.newbyteorder("<")))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            os.close(fd)
            return len(memoryview(data).cast("B"))

        futures = [_pool().submit(put, job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception()), None)
        if failed is not None:
            # Stop the rest and let those already writing finish, so the caller's discard sees every file.
            for f in futures:
                f.cancel()
            wait(futures)
            raise failed.exception()
        nbytes = sum(f.result() for f in futures)
        fsync_paths(dirs)
        return nbytes

    def _write_zarr(self, start: int, arrays: dict[str, np.ndarray]) -> int:
        """Write through zarr (blosc builds), then fsync the chunk files and every directory zarr may have added
        an entry to: FIELD/ (its `c/`), FIELD/c/ (chunk files, or `i/` for 2-D fields) and FIELD/c/i/."""
        n = next(iter(arrays.values())).shape[0]
        nbytes = 0
        to_sync: list[Path] = []
        for fld, a in arrays.items():
            self._arrays[fld][start : start + n] = a
            for p in chunk_paths(self.path, fld, start, n, self.chunk_tokens):
                nbytes += p.stat().st_size
                to_sync.append(p)
                to_sync.append(p.parent)
                if fld in ("hidden_state", "aux_hidden_state"):
                    to_sync.append(p.parent.parent)
            to_sync.append(self.path / fld)
        fsync_paths(to_sync)
        return nbytes

    def discard(self, token_start: int, num_tokens: int) -> None:
        """Remove whatever a failed (never committed) write left of its own range."""
        for fld in FIELDS:
            for p in chunk_paths(self.path, fld, token_start, num_tokens, self.chunk_tokens):
                p.unlink(missing_ok=True)
                for stray in p.parent.glob(p.name + ".*.partial"):
                    stray.unlink(missing_ok=True)

    def seal(self) -> dict:
        info = {"segment": self.name, "sealed_at": time.time(), "tokens": self.cursor, "samples": self.samples,
                "chunk_tokens": self.chunk_tokens}
        atomic_write_bytes(self.path / SEAL_NAME, json.dumps(info).encode())
        return info


def list_segments(data_root: Path) -> list[str]:
    if not data_root.is_dir():
        return []
    return sorted(p.name for p in data_root.iterdir() if p.is_dir() and p.name.startswith("seg-"))
