"""The data: a Zarr v3 group of write-once segments, ragged along the token axis.

    data/                          Zarr v3 group (layout attributes)
      seg-<run>-w<k>-<rand>/       one segment per writer start; only that writer ever writes into it
        input_ids/c.<s>            int32   [T]            shard s: tokens [s*S, (s+1)*S)
        loss_mask/c.<s>            uint8   [T]
        hidden_state/c.<s>.0       uint16  [T, H]         raw bfloat16 bit patterns (attribute logical_dtype)
        aux_hidden_state/c.<s>.0   uint16  [T, n_aux*H]
                                   (an fp8 build: uint8 [T, W + 4], W fp8 values then a float32 scale a token)
        samples/<token>.json       the manifest of the group of samples whose shards start at <token>
        seal.json                  written (atomically) when the writer stops cleanly

Layout 2 (this writer). Samples are appended in groups. Each sample starts on a chunk boundary; a group's
samples are encoded into memory, then the group is made durable with one barrier: every shard file it touches
is written once (O_EXCL, zarr's sharding format, see shard.py), all fsynced, then their directories; only then is
the group's manifest written and fsynced, then its directory, so a manifest never vouches for bytes that are not
durable. Only then are the samples reported written, and the next group starts on a fresh shard, so no file is
ever written twice. The manifest names each sample (id, fingerprint, attempt, location,
checksums): a segment describes itself, so a lost event log can be rebuilt from the data.

Layout 1 segments (one file per chunk, `c/<i>` and `c/<i>/0`, no manifests) are still read and verified.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from builder.config import DEFAULT_CODEC
from builder.fsutil import atomic_write_bytes, fsync_path, fsync_paths
from builder.store.codec import (
    FP8_SCHEME,
    checksum,
    chunk_encoder,
    fp8_error,
    parse_codec,
    quantize_fp8,
    stored_width,
    to_storage,
)
from builder.store.dtypes import STORAGE_DTYPES
from builder.store.history import ensure_run_record
from builder.store.shard import ShardGeometry, shard_parts, shard_path
from builder.store.zarr_meta import ZARR_JSON, create_doc, group_doc, read_array_meta, sharded_array_doc

FIELDS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
DIMS = {"input_ids": 1, "loss_mask": 1, "hidden_state": 2, "aux_hidden_state": 2}
SEGMENT_CAPACITY = 1 << 36  # tokens; arrays never resize
LAYOUT_VERSION = 2
SEAL_NAME = "seal.json"
MANIFEST_DIR = "samples"
MANIFEST_FORMAT = 1
SHARD_TARGET_BYTES = 64 << 20  # a shard file of aux states holds at most about this much raw data
MAX_SHARD_CHUNKS = 64  # the index costs 16 bytes a chunk in every shard file, used or not

if TYPE_CHECKING:  # (torch: tensors are handed in; the module itself is imported by torch-free commands)
    import torch


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _named_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A process-wide pool, made on first use: one, whichever threads ask first (two groups commit at once)."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return _POOLS[name]


def _pool() -> ThreadPoolExecutor:
    """Encoding (CPU: codecs release the GIL)."""
    return _named_pool("hsbuild-shard", max(4, min(16, 2 * (os.cpu_count() or 1))))


def _io_pool() -> ThreadPoolExecutor:
    """A group's file writes and fsyncs, apart from the encoding: a commit's threads waiting on the disk never
    hold up the encoding of the next samples (a shared pool had the next sample wait behind a group's fsyncs)."""
    return _named_pool("hsbuild-write", 16)


def shard_chunks_for(chunk_tokens: int, hidden_size: int, n_aux: int, itemsize: int = 2) -> int:
    """Inner chunks per shard: aux shards near SHARD_TARGET_BYTES raw, a power of two, 1..MAX_SHARD_CHUNKS."""
    per_chunk = max(1, chunk_tokens * n_aux * hidden_size * itemsize)
    n = max(1, min(MAX_SHARD_CHUNKS, SHARD_TARGET_BYTES // per_chunk))
    return 1 << (n.bit_length() - 1)


@dataclass
class Location:
    segment: str
    token_start: int
    num_tokens: int
    nbytes: int
    checksums: dict[str, str]
    disk_bytes: int = 0  # the sample's share of what its group occupies on disk (allocated blocks, manifest too)
    quant_error: dict[str, float] | None = None  # fp8 builds: each state field's relative RMS error as read back


@dataclass
class _Staged:
    """A sample encoded into memory, not yet durable."""

    sample_id: str
    fingerprint: str
    attempt: int
    location: Location
    extra: dict


def init_data_group(data_root: Path, attrs: dict) -> None:
    """The build's data group: its zarr.json (which must not exist yet) holds the build's layout attributes."""
    data_root.mkdir(parents=True, exist_ok=True)
    fsync_path(create_doc(data_root, group_doc({"hsbuild_layout": LAYOUT_VERSION, **attrs})))
    fsync_path(data_root)
    fsync_path(data_root.parent)


def chunk_paths_v1(seg_dir: Path, fld: str, token_start: int, num_tokens: int, chunk_tokens: int) -> list[Path]:
    """Layout 1: the chunk files holding tokens [token_start, token_start+num_tokens) of one field."""
    first = token_start // chunk_tokens
    last = (token_start + max(num_tokens, 1) - 1) // chunk_tokens
    base = seg_dir / fld / "c"
    if fld in ("input_ids", "loss_mask"):
        return [base / str(i) for i in range(first, last + 1)]
    return [base / str(i) / "0" for i in range(first, last + 1)]


def new_segment_name(run_id: str, worker: int) -> str:
    return f"seg-{run_id[:8]}-w{worker:02d}-{uuid.uuid4().hex[:6]}"


IOV_MAX = 1024  # buffers a writev(2) takes at most (Linux)


def _drop_cached(fd: int) -> None:
    """Ask the kernel to drop a file's cached pages: clean once fsynced, the file is not read again soon. A build
    writes terabytes once; kept cached, they would crowd out what the machine does read (the model's weights, the
    engine's files), count against a container's memory limit, and make every write take fresh pages (on a VM,
    first-touched guest memory: writing 800 MB took 1.8 s of system time there against 0.2 s when each file's
    pages were dropped and reused). A filesystem that keeps no page cache (tmpfs) ignores it."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: the data is durable either way


def _write_once(path: Path, data: bytes | list[bytes]) -> int:
    """Create `path` (never an existing one), write `data` (bytes, or buffers written one after another with
    gather writes, no copy into one) whole and fsync it; its cached pages are then dropped (`_drop_cached`)."""
    views = deque(v for v in (memoryview(b).cast("B") for b in ([data] if isinstance(data, bytes | bytearray)
                                                                  else data)) if len(v))
    total = sum(len(v) for v in views)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while views:
            n = os.writev(fd, list(itertools.islice(views, IOV_MAX)))
            while n:  # a short write: drop what went out, resume mid-buffer
                if n >= len(views[0]):
                    n -= len(views.popleft())
                else:
                    views[0], n = views[0][n:], 0
        os.fsync(fd)
        _drop_cached(fd)
    finally:
        os.close(fd)
    return total


def _write_files(jobs: list[tuple[Path, bytes | list[bytes]]], created: list[Path]) -> None:
    """Write each (path, data) once (`_write_once`), several on the I/O pool, and wait for all of them; a file
    this call created, whole or in part, goes into `created` (one that existed already is not ours). Raises the
    first error once every write has finished."""
    errors: list[BaseException | None] = [None] * len(jobs)
    if len(jobs) == 1:  # (one small file, the manifest: written on this thread)
        try:
            _write_once(*jobs[0])
        except BaseException as e:  # noqa: BLE001 - judged below, as the pool's are
            errors[0] = e
    else:
        futures = [_io_pool().submit(_write_once, p, d) for p, d in jobs]
        wait(futures)  # every write has finished (or failed) before anything is judged or removed
        errors = [f.exception() for f in futures]
    for (p, _), e in zip(jobs, errors, strict=True):
        if not isinstance(e, FileExistsError):
            created.append(p)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


@dataclass
class StagedGroup:
    """A group of samples taken out of a writer's staging (`SegmentWriter.detach`), not yet durable."""

    staged: list
    chunks: dict  # field -> {global chunk index: encoded bytes}
    start: int  # the group's first token address

    @property
    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self.staged]


@dataclass
class SegmentWriter:
    """The only writer of one segment. `add` stages samples in memory; `flush` makes the staged group durable
    with one barrier and returns their locations. `write` is `add` then `flush`."""

    data_root: Path
    name: str
    hidden_size: int
    n_aux: int
    chunk_tokens: int
    codec: str = DEFAULT_CODEC
    dtype: str = "bfloat16"
    quantize: str = "none"  # fp8: state fields stored as float8_e4m3fn with a float32 scale a token (lossy)
    shard_chunks: int = 0  # 0: chosen from the chunk size (shard_chunks_for)
    run_record: tuple[int, str] | None = None  # (ordinal, run id): the run's history record, ensured by `create`
    cursor: int = 0  # the next free token address
    samples: int = 0  # samples made durable
    groups: int = 0
    _group_start: int = 0
    _chunks: dict = field(default_factory=dict)  # field -> {global chunk index: encoded bytes}
    _staged: list = field(default_factory=list)
    _staged_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.shard_chunks:
            self.shard_chunks = shard_chunks_for(self.chunk_tokens, self.hidden_size, self.n_aux,
                                                 1 if self.quantize == "fp8" else 2)
        self.geometry = ShardGeometry(self.chunk_tokens, self.shard_chunks)
        self._encode = chunk_encoder(self.codec)
        self._encode_states = chunk_encoder(self.codec, 1) if self.quantize == "fp8" else self._encode
        self._chunks = {f: {} for f in FIELDS}
        self._count_lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.data_root / self.name

    @property
    def staged(self) -> int:
        return len(self._staged)

    @property
    def staged_bytes(self) -> int:
        """Encoded bytes waiting for the next flush."""
        return self._staged_bytes

    def create(self) -> SegmentWriter:
        """Create the segment's directories and metadata, durable (the data directory's entry included).
        On failure (a full disk) whatever was created is removed again and the error raised. First the run's
        history record (`run_record`), so that no segment exists without it (builder/store/history.py)."""
        if self.run_record is not None:
            ensure_run_record(self.data_root, *self.run_record)
        self.path.mkdir()  # exclusive: a segment name is never reused (FileExistsError: nothing is touched)
        try:
            self._create_metadata()
        except BaseException:
            self.remove()
            raise
        return self

    def _create_metadata(self) -> None:
        """The segment's group and its four sharded arrays (zarr_meta.py: the documents zarr would write)."""
        create_doc(self.path, group_doc({"segment": self.name, "created_at": time.time(),
                                         "hsbuild_layout": LAYOUT_VERSION, "shard_chunks": self.shard_chunks}))
        fp8 = self.quantize == "fp8"
        store_dtype = "uint8" if fp8 else STORAGE_DTYPES[self.dtype]
        width = {"input_ids": 1, "loss_mask": 1, "hidden_state": stored_width(self.hidden_size, self.quantize),
                 "aux_hidden_state": stored_width(self.n_aux * self.hidden_size, self.quantize)}
        state_attrs = {"logical_dtype": self.dtype, **({"quantized": FP8_SCHEME} if fp8 else {})}
        dtypes = {"input_ids": "int32", "loss_mask": "uint8", "hidden_state": store_dtype,
                  "aux_hidden_state": store_dtype}
        for fld in FIELDS:
            two_d = DIMS[fld] == 2
            row = (width[fld],) if two_d else ()
            (self.path / fld).mkdir()
            create_doc(self.path / fld, sharded_array_doc(
                shape=(SEGMENT_CAPACITY, *row), chunk_shape=(self.chunk_tokens, *row),
                shard_shape=(self.geometry.shard_tokens, *row), dtype=dtypes[fld],
                compressors=parse_codec(self.codec, 1 if fp8 and two_d else 2),
                attributes=state_attrs if two_d else {}))
        (self.path / MANIFEST_DIR).mkdir()
        fsync_paths([self.path / f / ZARR_JSON for f in FIELDS] + [self.path / f for f in FIELDS]
                    + [self.path / ZARR_JSON, self.path / MANIFEST_DIR, self.path])
        fsync_path(self.data_root)

    def remove(self) -> None:
        """Remove a segment that never held a committed sample (a failed create)."""
        import shutil  # noqa: PLC0415

        shutil.rmtree(self.path, ignore_errors=True)
        try:
            fsync_path(self.data_root)
        except OSError:
            pass

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray, aux: torch.Tensor, final: torch.Tensor, *,
            sample_id: str = "", fingerprint: str = "", attempt: int = 0, extra: dict | None = None) -> Location:
        """Encode one sample into the staged group. Not durable until `flush` returns."""
        n = int(input_ids.shape[0])
        start = self.cursor
        arrays = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int32),
            "loss_mask": np.ascontiguousarray(loss_mask, dtype=np.uint8),
            "hidden_state": self._store(final),
            "aux_hidden_state": self._store(aux),
        }
        c = self.chunk_tokens
        jobs = []
        for fld, a in arrays.items():
            first = start // c
            for k in range(-(-max(n, 1) // c)):
                part = a[k * c : (k + 1) * c]
                if part.shape[0] < c:  # the sample's last chunk: zero padding (the fill value) to full shape
                    full = np.zeros((c, *a.shape[1:]), dtype=a.dtype)
                    full[: part.shape[0]] = part
                    part = full
                jobs.append((fld, first + k, part))
        # the fields' checksums run on the pool beside the chunks' encoding (crc32c releases the GIL): computed
        # here, one after the other, they had the pool idle for a tenth of a sample's time
        sums = {f: _pool().submit(checksum, a) for f, a in arrays.items()}
        encoded = list(_pool().map(
            lambda j: (self._encode_states if DIMS[j[0]] == 2 else self._encode)(
                np.ascontiguousarray(j[2], dtype=j[2].dtype.newbyteorder("<"))), jobs))
        checksums = {f: fut.result() for f, fut in sums.items()}
        nbytes = 0
        for (fld, idx, _), data in zip(jobs, encoded, strict=True):
            self._chunks[fld][idx] = data
            nbytes += len(data)
        self.cursor = -(-(start + n) // c) * c
        quant_error = None
        if self.quantize == "fp8":
            quant_error = {"hidden_state": fp8_error(final, arrays["hidden_state"], self.dtype),
                           "aux_hidden_state": fp8_error(aux, arrays["aux_hidden_state"], self.dtype)}
        loc = Location(self.name, start, n, nbytes, checksums,
                       quant_error=quant_error)
        self._staged.append(_Staged(sample_id, fingerprint, attempt, loc, extra or {}))
        self._staged_bytes += nbytes
        return loc

    def _store(self, t: torch.Tensor) -> np.ndarray:
        """A state tensor [n, W] as its stored array (the checksums are of these bytes)."""
        return quantize_fp8(t) if self.quantize == "fp8" else to_storage(t)

    def flush(self) -> list[Location]:
        """Make the staged group durable: its shard files written once and fsynced, then their directories, then
        its manifest and the manifest's directory. Returns the group's locations. On failure nothing of the group
        remains on disk, the group is dropped (its samples must be extracted again) and the error is raised; the
        token range is abandoned, never reused."""
        group = self.detach()
        return [] if group is None else self.commit(group)

    def detach(self) -> StagedGroup | None:
        """Take the staged group out of the writer (its token range is left behind: the next sample starts on
        a fresh shard), so that it can be committed on another thread while more samples are added."""
        if not self._staged:
            return None
        group = StagedGroup(self._staged, self._chunks, self._group_start)
        self._staged, self._chunks, self._staged_bytes = [], {f: {} for f in FIELDS}, 0
        self.cursor = self._group_start = self.geometry.next_shard_start(self.cursor)
        return group

    def commit(self, group: StagedGroup) -> list[Location]:
        """Make a detached group durable (see `flush`). Commits of different groups may run at once (each writes
        its own shard files and manifest: a group starts on a fresh shard), and `add` and `detach` meanwhile
        (they touch only the staging side)."""
        staged, chunks, group_start = group.staged, group.chunks, group.start
        jobs = self._shard_jobs(chunks)
        manifest = {"format": MANIFEST_FORMAT, "segment": self.name, "written_at": time.time(),
                    "group_start": group_start, "chunk_tokens": self.chunk_tokens,
                    "samples": [{"sample_id": s.sample_id, "fingerprint": s.fingerprint, "attempt": s.attempt,
                                 "token_start": s.location.token_start, "num_tokens": s.location.num_tokens,
                                 "nbytes": s.location.nbytes, "checksums": s.location.checksums,
                                 **({"fp8_error": s.location.quant_error} if s.location.quant_error else {}),
                                 **s.extra}
                                for s in staged]}
        manifest_job = (self.path / MANIFEST_DIR / f"{group_start}.json", json.dumps(manifest).encode())
        created: list[Path] = []  # files this commit created (whole or in part): removed again on failure
        try:
            _write_files(jobs, created)  # the shard files, written and fsynced in parallel
            fsync_paths({p.parent for p, _ in jobs})  # and their directory entries
            # only now the manifest: it must never be durable while a shard it vouches for is not (a crash
            # between the two would leave a group whose manifest names samples with missing bytes)
            _write_files([manifest_job], created)
            fsync_path(manifest_job[0].parent)
        except BaseException:
            for p in created:
                p.unlink(missing_ok=True)
            raise
        jobs.append(manifest_job)
        allocated = 0
        for path, _ in jobs:
            try:
                allocated += os.stat(path).st_blocks * 512
            except OSError:
                pass
        data_bytes = sum(s.location.nbytes for s in staged) or 1
        for s in staged:
            s.location.disk_bytes = allocated * s.location.nbytes // data_bytes
        with self._count_lock:
            self.samples += len(staged)
            self.groups += 1
        return [s.location for s in staged]

    def _shard_jobs(self, chunks: dict[str, dict[int, bytes]]) -> list[tuple[Path, list[bytes]]]:
        jobs = []
        sc = self.shard_chunks
        for fld, by_idx in chunks.items():
            shards: dict[int, list] = {}
            for idx, data in by_idx.items():
                shards.setdefault(idx // sc, [None] * sc)[idx % sc] = data
            for s, inner in sorted(shards.items()):
                jobs.append((shard_path(self.path, fld, DIMS[fld], s), shard_parts(inner)))
        return jobs

    def write(self, input_ids: np.ndarray, loss_mask: np.ndarray, aux: torch.Tensor, final: torch.Tensor,
              **kw: object) -> Location:
        """Write one sample whole and make it durable (a group of one)."""
        self.add(input_ids, loss_mask, aux, final, **kw)  # type: ignore[arg-type]
        return self.flush()[0]

    def seal(self) -> dict:
        info = {"segment": self.name, "sealed_at": time.time(), "tokens": self.cursor, "samples": self.samples,
                "groups": self.groups, "chunk_tokens": self.chunk_tokens, "shard_chunks": self.shard_chunks,
                "layout": LAYOUT_VERSION}
        atomic_write_bytes(self.path / SEAL_NAME, json.dumps(info).encode())
        return info




def read_manifests(seg_dir: Path) -> list[dict]:
    """Every readable group manifest of a segment, in token order (unreadable ones are skipped)."""
    out = []
    d = seg_dir / MANIFEST_DIR
    if not d.is_dir():
        return out
    for p in d.iterdir():
        if not p.name.endswith(".json") or p.name.startswith("."):
            continue
        try:
            m = json.loads(p.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT:
            out.append(m)
    return sorted(out, key=lambda m: m.get("group_start", 0))


def list_segments(data_root: Path) -> list[str]:
    if not data_root.is_dir():
        return []
    return sorted(p.name for p in data_root.iterdir() if p.is_dir() and p.name.startswith("seg-"))


def field_geometry(seg_dir: Path, fld: str) -> tuple[int, int]:
    """(inner chunk tokens, inner chunks per shard file; 0 when the field is not sharded) from its zarr.json
    (`zarr_meta.read_array_meta`: OSError, or ValueError, KeyError, IndexError or TypeError when malformed)."""
    meta = read_array_meta(seg_dir / fld)
    return meta.chunk_tokens, meta.shard_chunks


def sample_files(seg_dir: Path, fld: str, token_start: int, num_tokens: int) -> list[Path]:
    """The files holding a sample's tokens of one field: its shard files (layout 2; shared with the other
    samples of its group) or its own chunk files (layout 1)."""
    chunk_tokens, shard_chunks = field_geometry(seg_dir, fld)
    if not shard_chunks:
        return chunk_paths_v1(seg_dir, fld, token_start, num_tokens, chunk_tokens)
    geo = ShardGeometry(chunk_tokens, shard_chunks)
    return [shard_path(seg_dir, fld, DIMS[fld], s) for s in geo.shards(token_start, num_tokens)]
