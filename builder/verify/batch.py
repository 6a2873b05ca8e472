"""Checking a sweep's samples a group at a time: what makes `hsbuild verify` run at the storage's speed.

Small samples share shard files (a group of them is written as one set of shards, builder/store/segment.py), so
checking them one by one opens, reads and checks every shard's index once per sample, and the segment's metadata
files five times per sample. A *unit* here is a run of the sweep's samples (in segment and token order) that
start in the same shard, or the samples of a few consecutive shards (`verify.targets.Targets.units`):
`check_unit` probes the segment's metadata files once, then for each field opens each shard file the unit needs
once, checks its index once (`store.shard.read_index`: its CRC-32C, and that it accounts for exactly the file's
bytes), and, in a full sweep, reads the unit's chunks with one read per run of consecutive chunks, decodes each
chunk once, exactly as hsbuild's reader does (`store.direct`: a chunk must decode to exactly its chunk's bytes),
and chains the CRC-32C of each sample's rows, field by field.

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
from builder.store.codec import BLOSC_HEADER, declared_size
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
    """The state of one unit's check, as arrays over its samples: who failed (and the Redo each got first), bytes
    and running checksums."""

    def __init__(self, targets: Sequence, quick: bool):
        self.targets = targets
        self.quick = quick
        n = len(targets)
        self.failed = np.zeros(n, dtype=bool)
        self.redo: dict[int, Redo] = {}
        self.file_bytes = np.zeros(n, dtype=np.int64)
        self.raw_bytes = np.zeros(n, dtype=np.int64)
        self.start = np.fromiter((t.token_start for t in targets), dtype=np.int64, count=n)
        self.count = np.fromiter((t.num_tokens for t in targets), dtype=np.int64, count=n)

    def fail(self, idx: Sequence[int] | np.ndarray, err: BaseException | None) -> None:
        """These samples go to the per-sample check (`err`: what stopped the group check, if anything)."""
        first = err if err is not None and is_transient(err) else None
        for i in np.asarray(idx, dtype=np.int64).tolist():
            if not self.failed[i]:
                self.failed[i] = True
                self.redo[i] = Redo(first)


def check_unit(data_root: Path, segment: str, lays: dict[str, FieldLayout], targets: Sequence,
               quick: bool) -> list[Outcome]:
    """Check `targets` (one segment, ascending token_start; each has token_start, num_tokens, nbytes, checksums)
    whose fields are all read directly (`lays`). Returns per target a passing SampleCheck or a `Redo`."""
    u = _Unit(targets, quick)
    n = len(targets)
    try:
        store_reader.probe_metadata(data_root, segment)
    except (DamagedSampleError, OSError, MemoryError) as e:
        u.fail(np.arange(n), None if isinstance(e, DamagedSampleError) else e)
        return [u.redo[i] for i in range(n)]
    want, wok = (None, None) if quick else _wanted_all([t.checksums for t in targets])
    seg_dir = data_root / segment
    for f, fld in enumerate(FIELDS):
        _check_field(u, seg_dir, segment, fld, lays[fld], None if want is None else want[:, f],
                     None if wok is None else wok[:, f])
    if quick:
        said = np.fromiter((-1 if t.nbytes is None else t.nbytes for t in targets), dtype=np.int64, count=n)
        u.fail(np.flatnonzero(~u.failed & (said >= 0) & (said != u.file_bytes)), None)  # the per-sample check
    redo, fb, rb = u.redo, u.file_bytes.tolist(), u.raw_bytes.tolist()  # words the difference
    return [redo[i] if i in redo else SampleCheck(None, fb[i], rb[i]) for i in range(n)]


def _wanted(checksums: str | dict | None) -> dict[str, int] | None:
    """The `written` event's checksums as integers, None when they do not parse (the per-sample check says why)."""
    try:
        d = json.loads(checksums) if isinstance(checksums, str) else dict(checksums or {})
        return {f: int(d[f].removeprefix("crc32c:"), 16) for f in FIELDS if str(d[f]).startswith("crc32c:")}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# the `written` event's checksums as a run writes them (json.dumps, sort_keys): parsed for a whole unit at once
_TEMPLATE = json.dumps({f: "crc32c:" + "0" * 8 for f in FIELDS}, sort_keys=True).encode()
_HEX_AT = np.array([_TEMPLATE.index(f'"{f}": "crc32c:'.encode()) + len(f) + 12 for f in FIELDS], dtype=np.int64)
_HEX_POS = (_HEX_AT[:, None] + np.arange(8)).reshape(-1)  # where the 4 x 8 hex digits are, in field order
_FIXED = np.ones(len(_TEMPLATE), dtype=bool)
_FIXED[_HEX_POS] = False
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)


def _wanted_all(sums: list) -> tuple[np.ndarray, np.ndarray]:
    """Every target's checksums as a (samples, fields) array of integers and whether each is known (`_wanted`:
    a field with a crc32c checksum; none of a sample whose checksums do not parse). Those written as a run writes
    them are parsed together with numpy; any other goes through `_wanted`."""
    n, width = len(sums), len(_TEMPLATE)
    want = np.zeros((n, len(FIELDS)), dtype=np.int64)
    wok = np.zeros((n, len(FIELDS)), dtype=bool)
    fast = np.zeros(n, dtype=bool)
    cand = np.fromiter((type(s) is str and len(s) == width for s in sums), dtype=bool, count=n)
    if cand.any():
        at = np.flatnonzero(cand)
        raw = "".join([sums[i] for i in at.tolist()]).encode("utf-8", "replace")
        if len(raw) == at.size * width:  # (every one ASCII)
            rows = np.frombuffer(raw, dtype=np.uint8).reshape(at.size, width)
            digits = _HEX[rows[:, _HEX_POS]].reshape(at.size, len(FIELDS), 8)
            tmpl = np.frombuffer(_TEMPLATE, dtype=np.uint8)
            good = (rows[:, _FIXED] == tmpl[_FIXED]).all(axis=1) & (digits != 255).all(axis=(1, 2))
            shifts = np.arange(28, -1, -4, dtype=np.int64)
            want[at[good]] = (digits[good].astype(np.int64) << shifts).sum(axis=2)
            wok[at[good]] = True
            fast[at[good]] = True
    for i in np.flatnonzero(~fast).tolist():
        d = _wanted(sums[i])
        if d is not None:
            for f, fld in enumerate(FIELDS):
                if fld in d:
                    want[i, f], wok[i, f] = d[fld], True
    return want, wok


def _check_field(u: _Unit, seg_dir: Path, segment: str, fld: str, lay: FieldLayout, want: np.ndarray | None,
                 wok: np.ndarray | None) -> None:
    c, sc = lay.inner, lay.shard_chunks
    if wok is not None:
        u.fail(np.flatnonzero(~u.failed & ~wok), None)
    live = np.flatnonzero(~u.failed)
    if not live.size:
        return
    first = u.start[live] // c
    last = (u.start[live] + np.maximum(u.count[live], 1) - 1) // c
    s_first, s_last = first // sc, last // sc
    crc = [0] * len(u.targets)
    for s in range(int(s_first.min()), int(s_last.max()) + 1):
        inside = (s_first <= s) & (s_last >= s)
        if not inside.any():
            continue
        ids = live[inside]
        lo = np.maximum(first[inside], s * sc) - s * sc  # the members' first and last chunk in this shard
        hi = np.minimum(last[inside], (s + 1) * sc - 1) - s * sc
        try:
            _check_shard(u, shard_path(seg_dir, fld, lay.dims, s), s, lay, ids, lo, hi, crc, segment, fld)
        except (DamagedSampleError, ShardIndexError):  # the per-sample check finds and words it
            u.fail(ids, None)
        except (OSError, MemoryError) as e:
            u.fail(ids, e)
        except Exception:  # noqa: BLE001 - whatever else this path meets, the per-sample check decides and words
            u.fail(ids, None)
    if want is not None:
        ok = live[~u.failed[live]]
        got = np.fromiter((crc[i] for i in ok.tolist()), dtype=np.int64, count=ok.size)
        u.fail(ok[got != want[ok]], None)


def _check_shard(u: _Unit, path: Path, shard: int, lay: FieldLayout, ids: np.ndarray, lo: np.ndarray,
                 hi: np.ndarray, crc: list[int], segment: str, fld: str) -> None:
    """One shard file of the unit: probed (as every reader does first, `store.reader.probe_file`), opened once
    (through pathlib, as Zarr's store opens it), its index checked (`read_index`), the chunks of samples `ids`
    (positions `lo`..`hi` in the shard) present; in a full sweep read, decoded and checksummed into `crc`."""
    if store_reader.probe_file(path) == 0:
        raise ShardIndexError("empty")
    with path.open("rb", buffering=0) as fh:
        idx = read_index(fh.fileno(), lay.shard_chunks)
        empty = idx[:, 0] == EMPTY
        absent = np.concatenate(([0], np.cumsum(empty)))
        sizes = np.concatenate(([0], np.cumsum(np.where(empty, 0, idx[:, 1]).astype(np.int64))))
        gone = (absent[hi + 1] - absent[lo]) > 0
        if gone.any():
            u.fail(ids[gone], None)
        u.file_bytes[ids] += sizes[hi + 1] - sizes[lo]  # (ids: distinct)
        if u.quick:
            return
        keep = ~u.failed[ids]
        if not keep.any():
            return
        lo, hi, ids = lo[keep], hi[keep], ids[keep]
        m = lay.shard_chunks + 1  # the union of the samples' chunk ranges
        need = np.flatnonzero(np.cumsum(np.bincount(lo, minlength=m) - np.bincount(hi + 1, minlength=m))[:-1] > 0)
        flat = _decoded(fh, path, idx, need, lay, segment, fld)
    # each sample's chunks are consecutive rows of `flat` (need is sorted and holds all of lo..hi): its bytes here
    # are one span of it
    c = lay.inner
    row_bytes = (lay.width or 1) * lay.dtype.itemsize
    base = (shard * lay.shard_chunks + lo) * c  # the first token of each sample's first chunk here
    a = np.maximum(u.start[ids] - base, 0)
    b = np.minimum(u.start[ids] + u.count[ids] - base, (hi - lo + 1) * c)
    at = np.searchsorted(need, lo) * c
    has = b > a
    ids, a, b, at = ids[has], a[has], b[has], at[has]
    u.raw_bytes[ids] += (b - a) * row_bytes
    view = memoryview(flat).cast("B")
    for i, x, y in zip(ids.tolist(), ((at + a) * row_bytes).tolist(), ((at + b) * row_bytes).tolist(), strict=True):
        crc[i] = crc32c.crc32c(view[x:y], crc[i])


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


_HEADER_AT = np.arange(BLOSC_HEADER.size)


def _blosc_sizes(buf: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The `nbytes` and `cbytes` of the blosc headers at offsets `at` of `buf` (uint8; BLOSC_HEADER)."""
    h = buf[at[:, None] + _HEADER_AT].view("<u4")
    return h[:, 1], h[:, 3]


def _decoded(fh, path: Path, idx: np.ndarray, need: np.ndarray, lay: FieldLayout, segment: str,
             fld: str) -> np.ndarray:
    """Inner chunks `need` (positions in the shard, ascending) decoded, one row each, exactly a chunk's bytes
    (`store.direct`'s decode: a chunk that decodes to any other size is damage). A chunk whose header says it
    is exactly a chunk's size is decoded straight into its row by the codec's own function (what the codec's
    `decode(buf, out=row)` calls, without its checks of the arguments); any other goes through `store.direct`.
    Blosc headers are read for all the chunks at once (`codec.declared_size`'s rule: the header's compressed size
    must be the chunk's length)."""
    chunk_bytes = lay.inner * (lay.width or 1) * lay.dtype.itemsize
    out = np.empty((len(need), chunk_bytes), dtype=np.uint8)
    buf, pos = _read_chunks(fh, idx, need)
    size = idx[need, 1].astype(np.int64)
    codec = lay.codec
    if codec is None:
        if (size != chunk_bytes).any():
            raise ShardIndexError(f"a chunk is not {chunk_bytes} bytes long")
        for row, p in enumerate(pos.tolist()):
            out[row] = buf[p : p + chunk_bytes]
        return out
    blosc = isinstance(codec, numcodecs.Blosc)
    slow = np.zeros(len(need), dtype=bool)  # blosc chunks whose header says another size: through store.direct
    if blosc:
        if (size < BLOSC_HEADER.size).any():
            raise ShardIndexError("a blosc chunk shorter than its header")
        said, cbytes = _blosc_sizes(buf, pos)
        if (cbytes != size).any():  # c-blosc trusts its header's compressed size
            raise ShardIndexError("a blosc chunk whose header says another length")
        slow = said != chunk_bytes
    raw = BLOSC_DECOMPRESS if blosc else None
    fast = (numcodecs.blosc.decompress if blosc
            else numcodecs.zstd.decompress if isinstance(codec, numcodecs.Zstd) else None)
    view = memoryview(buf)
    if raw is not None:
        base, out_at = buf.ctypes.data, out.ctypes.data
        rows = np.flatnonzero(~slow)
        for src_at, dst_at in zip((pos[rows] + base).tolist(), (rows * chunk_bytes + out_at).tolist(), strict=True):
            if raw(src_at, dst_at, chunk_bytes, 1) != chunk_bytes:
                raise ShardIndexError("a chunk does not decode")
        todo = np.flatnonzero(slow).tolist()
    else:
        todo = range(len(need))
    for row, p, m in zip(todo, pos[todo].tolist(), size[todo].tolist(), strict=True):
        src = view[p : p + m]
        if fast is not None and not slow[row] and (blosc or declared_size(codec, src) == chunk_bytes):
            fast(src, out[row])
        else:
            err = _decode(codec, src, out[row], path.relative_to(path.parent.parent), segment, fld)
            if err is not None:
                raise err
    return out


def _read_chunks(fh, idx: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The encoded bytes of inner chunks `need` (positions in the shard), read with one read per run of chunks
    that lie less than MERGE_GAP apart, in one buffer, and where each chunk starts in it."""
    start = idx[need, 0].astype(np.int64)
    end = start + idx[need, 1].astype(np.int64)
    first, stop = int(start.min()), int(end.max())
    if stop - first - int((end - start).sum()) <= MERGE_GAP:  # no gap between them is wider: one run
        buf = np.empty(stop - first, dtype=np.uint8)
        _pread_exact(fh, memoryview(buf), first)
        return buf, start - first
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)  # a run goes on while the next chunk starts within MERGE_GAP of its end
    new = np.concatenate(([True], s[1:] - reach[:-1] > MERGE_GAP))
    run = np.cumsum(new) - 1
    run_start = s[new]
    run_end = np.maximum.reduceat(e, np.flatnonzero(new))
    lens = run_end - run_start
    at = np.concatenate(([0], np.cumsum(lens)))  # where each run lies in the buffer
    buf = np.empty(int(at[-1]), dtype=np.uint8)
    view = memoryview(buf)
    for r, (a, n) in enumerate(zip(run_start.tolist(), lens.tolist(), strict=True)):
        _pread_exact(fh, view[int(at[r]) : int(at[r]) + n], a)
    pos = np.empty(len(need), dtype=np.int64)
    pos[order] = at[run] + s - run_start[run]
    return buf, pos


def _pread_exact(fh, view: memoryview, offset: int) -> None:
    n = len(view)
    done = 0
    while done < n:
        fh.seek(offset + done)
        got = fh.readinto(view[done:])
        if not got:
            raise ShardIndexError(f"read {done} of {n} bytes")
        done += got
