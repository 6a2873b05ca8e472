"""Checking a sweep's samples a group at a time: what makes `hsbuild verify` run at the storage's speed.

Small samples share shard files (a group of them is written as one set of shards, builder/store/segment.py), so
checking them one by one opens, reads and checks every shard's index once per sample, and the segment's metadata
files five times per sample. A *unit* here is a run of the sweep's samples (in segment and token order) that
start in the same shard: `check_unit` probes the segment's metadata files once, then for each field opens each
shard file the unit needs once, checks its index once (`store.shard.read_index`: its CRC-32C, and that it
accounts for exactly the file's bytes), and, in a full sweep, reads the unit's chunks with one read per run of
consecutive chunks, decodes each chunk once, exactly as hsbuild's reader does (`store.direct`: a chunk must
decode to exactly its chunk's bytes), and chains the CRC-32C of each sample's rows, field by field.

This path only ever *passes* a sample. Anything else it meets (a file missing, empty or damaged, an index
that fails, a chunk that does not decode, a checksum that differs, an error of the I/O path) sends the samples
concerned to the per-sample check (`store.readback.check_sample` / `check_files`, through Zarr), which decides
and words the finding exactly as before; a transient error (EMFILE, EIO, MemoryError, ...) counts as that
sample's first try, so the retries and their count are those of a sample checked alone. Segments this path does
not read (layout 1, a codec hsbuild does not decode itself) are checked sample by sample.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numcodecs
import numcodecs.blosc
import numcodecs.zstd
import numpy as np

from builder.errors import DamagedSampleError
from builder.store import reader as store_reader
from builder.store.codec import declared_size
from builder.store.direct import FieldLayout, _decode
from builder.store.readback import SampleCheck, is_transient
from builder.store.segment import FIELDS
from builder.store.shard import EMPTY, ShardIndexError, read_index, shard_path

MERGE_GAP = 256 << 10  # chunks of a unit less than this many bytes apart are read with one read
UNIT_SAMPLES = 256  # at most this many samples a unit (its verdicts come back together)
UNIT_BYTES = 64 << 20  # ... and about this many compressed bytes


@dataclass
class Redo:
    """A sample the group check could not pass: check it alone (`first_error`: a transient error that counts as
    its first try, None: from the start)."""

    first_error: BaseException | None = None


Outcome = SampleCheck | Redo


class _Unit:
    """The state of one unit's check: per sample, its outcome so far, bytes and running checksums."""

    def __init__(self, targets: Sequence, quick: bool):
        self.targets = targets
        self.quick = quick
        n = len(targets)
        self.redo: list[Redo | None] = [None] * n
        self.file_bytes = [0] * n
        self.raw_bytes = [0] * n
        self.start = np.array([t.token_start for t in targets], dtype=np.int64)
        self.count = np.array([t.num_tokens for t in targets], dtype=np.int64)

    def fail(self, idx: Sequence[int], err: BaseException | None) -> None:
        """These samples go to the per-sample check (`err`: what stopped the group check, if anything)."""
        first = err if err is not None and is_transient(err) else None
        for i in idx:
            if self.redo[i] is None:
                self.redo[i] = Redo(first)


def check_unit(data_root: Path, segment: str, lays: dict[str, FieldLayout], targets: Sequence,
               quick: bool) -> list[Outcome]:
    """Check `targets` (one segment, ascending token_start; each has token_start, num_tokens, nbytes, checksums)
    whose fields are all read directly (`lays`). Returns per target a passing SampleCheck or a `Redo`."""
    u = _Unit(targets, quick)
    everyone = range(len(targets))
    try:
        store_reader.probe_metadata(data_root, segment)
    except (DamagedSampleError, OSError, MemoryError) as e:
        u.fail(everyone, None if isinstance(e, DamagedSampleError) else e)
        return [u.redo[i] for i in everyone]  # type: ignore[misc]
    want = [None] * len(targets) if quick else [_wanted(t.checksums) for t in targets]
    seg_dir = data_root / segment
    for fld in FIELDS:
        _check_field(u, seg_dir, segment, fld, lays[fld], want)
    out: list[Outcome] = []
    for i, t in enumerate(targets):
        r = u.redo[i]
        if r is None and quick and t.nbytes is not None and u.file_bytes[i] != t.nbytes:
            r = Redo()  # the per-sample check words the difference
        out.append(r if r is not None else SampleCheck(None, u.file_bytes[i], u.raw_bytes[i]))
    return out


def _wanted(checksums: str | dict | None) -> dict[str, int] | None:
    """The `written` event's checksums as integers, None when they do not parse (the per-sample check says why)."""
    try:
        d = json.loads(checksums) if isinstance(checksums, str) else dict(checksums or {})
        return {f: int(d[f].removeprefix("crc32c:"), 16) for f in FIELDS if str(d[f]).startswith("crc32c:")}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_field(u: _Unit, seg_dir: Path, segment: str, fld: str, lay: FieldLayout,
                 want: list[dict[str, int] | None]) -> None:
    c, sc = lay.inner, lay.shard_chunks
    live = [i for i in range(len(u.targets)) if u.redo[i] is None]
    if not u.quick:
        bad = [i for i in live if want[i] is None or fld not in want[i]]  # type: ignore[operator]
        if bad:
            u.fail(bad, None)
            live = [i for i in live if u.redo[i] is None]
    if not live:
        return
    first = u.start[live] // c
    last = (u.start[live] + np.maximum(u.count[live], 1) - 1) // c
    shards: dict[int, list[int]] = {}  # shard -> positions in `live` of the samples with chunks in it
    for j, (a, b) in enumerate(zip((first // sc).tolist(), (last // sc).tolist(), strict=True)):
        for s in range(a, b + 1):
            shards.setdefault(s, []).append(j)
    crc = dict.fromkeys(live, 0)
    for s, members in sorted(shards.items()):
        js = np.asarray(members)
        lo = np.maximum(first[js], s * sc) - s * sc  # the members' first and last chunk in this shard
        hi = np.minimum(last[js], (s + 1) * sc - 1) - s * sc
        ids = [live[j] for j in members]
        try:
            _check_shard(u, shard_path(seg_dir, fld, lay.dims, s), s, lay, ids, lo, hi, crc, segment, fld)
        except (DamagedSampleError, ShardIndexError):  # the per-sample check finds and words it
            u.fail(ids, None)
        except (OSError, MemoryError) as e:
            u.fail(ids, e)
        except Exception:  # noqa: BLE001 - whatever else this path meets, the per-sample check decides and words
            u.fail(ids, None)
    if not u.quick:
        u.fail([i for i in live if u.redo[i] is None and crc[i] != want[i][fld]], None)  # type: ignore[index]


def _check_shard(u: _Unit, path: Path, shard: int, lay: FieldLayout, ids: list[int], lo: np.ndarray,
                 hi: np.ndarray, crc: dict[int, int], segment: str, fld: str) -> None:
    """One shard file of the unit: probed (as every reader does first, `store.reader.probe_file`), opened once
    (through pathlib, as Zarr's store opens it), its index checked (`read_index`), the chunks of samples `ids`
    (positions `lo`..`hi` in the shard) present; in a full sweep read, decoded and checksummed into `crc`."""
    if store_reader.probe_file(path) == 0:
        raise ShardIndexError("empty")
    with path.open("rb", buffering=0) as fh:
        idx = read_index(fh.fileno(), lay.shard_chunks)
        absent = np.concatenate(([0], np.cumsum(idx[:, 0] == EMPTY)))
        sizes = np.concatenate(([0], np.cumsum(np.where(idx[:, 0] == EMPTY, 0, idx[:, 1]))))
        gone = (absent[hi + 1] - absent[lo]) > 0
        if gone.any():
            u.fail([i for i, g in zip(ids, gone.tolist(), strict=True) if g], None)
        for i, n in zip(ids, (sizes[hi + 1] - sizes[lo]).tolist(), strict=True):
            u.file_bytes[i] += n
        if u.quick:
            return
        keep = [j for j, i in enumerate(ids) if u.redo[i] is None]
        if not keep:
            return
        lo, hi = lo[keep], hi[keep]
        ids = [ids[j] for j in keep]
        need = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(lo.tolist(), hi.tolist(),
                                                                            strict=True)]))
        flat = _decoded(fh, path, idx, need, lay, segment, fld)
    # each sample's chunks are consecutive rows of `flat` (need is sorted and holds all of lo..hi)
    c = lay.inner
    row_bytes = (lay.width or 1) * lay.dtype.itemsize
    row_of = np.searchsorted(need, lo)
    base = (shard * lay.shard_chunks + lo) * c  # the first token of each sample's first chunk here
    view = memoryview(flat).cast("B")
    for i, b0, r0, h in zip(ids, base.tolist(), row_of.tolist(), (hi - lo + 1).tolist(), strict=True):
        t = u.targets[i]
        a = max(t.token_start - b0, 0)
        b = min(t.token_start + t.num_tokens - b0, h * c)
        if b > a:
            crc[i] = crc32c.crc32c(view[(r0 * c + a) * row_bytes : (r0 * c + b) * row_bytes], crc[i])
            u.raw_bytes[i] += (b - a) * row_bytes


def _blosc_decompress_ctx() -> Callable[[int, int, int, int], int] | None:
    """c-blosc's `blosc_decompress_ctx(src, dest, destsize, nthreads)` from numcodecs' own extension, called
    without numcodecs' Python wrapper: for a chunk of a few kB its argument checks (two array coercions and a
    look at the current process, 20-30 us) cost several times the decoding. The same C function numcodecs calls
    in a thread that is not the main one, and like it run without the GIL (ctypes releases it). None where the
    symbol cannot be found: numcodecs then decodes."""
    try:
        fn = ctypes.CDLL(numcodecs.blosc.__file__).blosc_decompress_ctx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


BLOSC_DECOMPRESS = _blosc_decompress_ctx()


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


def _decoded(fh, path: Path, idx: np.ndarray, need: np.ndarray, lay: FieldLayout, segment: str,
             fld: str) -> np.ndarray:
    """Inner chunks `need` (positions in the shard, ascending) decoded, one row each, exactly a chunk's bytes
    (`store.direct`'s decode: a chunk that decodes to any other size is damage). A chunk whose header says it
    is exactly a chunk's size is decoded straight into its row by the codec's own function (what the codec's
    `decode(buf, out=row)` calls, without its checks of the arguments); any other goes through `store.direct`."""
    chunk_bytes = lay.inner * (lay.width or 1) * lay.dtype.itemsize
    out = np.empty((len(need), chunk_bytes), dtype=np.uint8)
    chunks = _read_chunks(fh, idx, need.tolist())
    codec = lay.codec
    blosc = isinstance(codec, numcodecs.Blosc)
    raw = BLOSC_DECOMPRESS if blosc else None
    fast = (numcodecs.blosc.decompress if blosc
            else numcodecs.zstd.decompress if isinstance(codec, numcodecs.Zstd) else None)
    out_at = out.ctypes.data
    for row, k in enumerate(need.tolist()):
        src, src_at = chunks[k]
        if codec is None:
            if len(src) != chunk_bytes:
                raise ShardIndexError(f"a chunk is not {chunk_bytes} bytes long")
            out[row] = np.frombuffer(src, dtype=np.uint8)
        elif fast is not None and declared_size(codec, src) == chunk_bytes:
            if raw is None:
                fast(src, out[row])
            elif raw(src_at, out_at + row * chunk_bytes, chunk_bytes, 1) != chunk_bytes:  # (the header's cbytes
                raise ShardIndexError("a chunk does not decode")  # is the chunk's length: declared_size)
        else:
            err = _decode(codec, src, out[row], path.relative_to(path.parent.parent), segment, fld)
            if err is not None:
                raise err
    return out


def _read_chunks(fh, idx: np.ndarray, need: list[int]) -> dict[int, tuple[memoryview, int]]:
    """The encoded bytes of inner chunks `need` (positions in the shard) and their address in memory, with one read
    per run of chunks that lie less than MERGE_GAP apart."""
    out: dict[int, tuple[memoryview, int]] = {}
    spans = sorted((int(idx[k, 0]), int(idx[k, 0] + idx[k, 1]), k) for k in need)
    i = 0
    while i < len(spans):
        start, end, j = spans[i][0], spans[i][1], i + 1
        while j < len(spans) and spans[j][0] - end <= MERGE_GAP:
            end = max(end, spans[j][1])
            j += 1
        buf = _pread_exact(fh, end - start, start)
        data, at = memoryview(buf), _address(buf)
        for s, e, k in spans[i:j]:
            out[k] = data[s - start : e - start], at + s - start
        i = j
    return out


def _pread_exact(fh, n: int, offset: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        fh.seek(offset + done)
        got = fh.readinto(view[done:])
        if not got:
            raise ShardIndexError(f"read {done} of {n} bytes")
        done += got
    return buf
