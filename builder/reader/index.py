"""The reader's index: where each live sample of a build is, as columns of numbers (bytes, not Python objects).

One entry per live sample, in source order (row, then sample id): its id, row, segment, first token, token count
and the checksums of its `written` event. Held as numpy arrays, about 60 B a sample plus its id's bytes (every
checksum in hsbuild's own form, `crc32c:` and 8 hex digits, is 4 bytes; any other is kept as its text).

An index lives in memory, or in a file (`write`, `open`) that every process maps: the page cache holds one copy
for all of a machine's readers (DataLoader workers, forked or spawned, and training ranks). Pickled, a file's
index is its path and the digest of its contents (a spawned worker maps the same file and checks it is the
same index); an index in memory pickles its arrays.

File: 8-byte magic, the header's length (u64, little-endian), the header (JSON: version, the key it was made
for, the count, each column's dtype, shape and offset, the segment names, the CRC-32C of everything after the
header), then the columns, each at a 64-byte aligned offset.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np

from builder.store.segment import FIELDS

MAGIC = b"HSBIDX\x00\x01"
VERSION = 1
ALIGN = 64

NO_CHECKSUMS, CRC32C, RAW = 0, 1, 2  # how an entry's checksums are held (column `checks`)
# hsbuild's own form of a `written` event's checksums (builder/run/handling.py: json.dumps, sort_keys=True)
TEMPLATE = json.dumps({f: "crc32c:00000000" for f in FIELDS}, sort_keys=True).encode()
SLOTS = [TEMPLATE.index(f'"{f}": "crc32c:'.encode()) + len(f'"{f}": "crc32c:') for f in FIELDS]  # FIELDS order

# column: dtype (shape: (n,) unless said)
COLUMNS = {
    "row_idx": "<i8", "token_start": "<i8", "num_tokens": "<i8",  # -1: NULL in the log
    "segment": "<u4",  # into the header's segment names
    "checks": "u1",  # NO_CHECKSUMS, CRC32C, RAW
    "crc": "<u4",  # (n, 4): FIELDS order
    "id_off": "<i8", "id_data": "u1",  # sample ids: UTF-8, (n + 1) offsets
    "raw_pos": "<i8", "raw_off": "<i8", "raw_data": "u1",  # the RAW entries' checksums text
}


class IndexFileError(ValueError):
    """An index file that is not a whole index of this version for the key asked (it is then built again)."""


def strings(off: np.ndarray, data: np.ndarray, i: int) -> str:
    return data[off[i]:off[i + 1]].tobytes().decode()


class ReaderIndex:
    """The live samples of a build as columns. `index[i]` is entry i as a dict (sample_id, row_idx, segment,
    token_start, num_tokens, checksums: the `written` event's JSON text, or None), as the `samples` view gives it;
    `location(i)` is what a read needs."""

    def __init__(self, cols: dict[str, np.ndarray], segments: list[str | None], key: dict,
                 path: Path | None = None, digest: int | None = None):
        self.cols, self.segments, self.key = cols, segments, key
        self.path, self.digest = path, digest
        self.n = len(cols["row_idx"])
        c = cols
        self.row_idx, self.token_start, self.num_tokens = c["row_idx"], c["token_start"], c["num_tokens"]
        self.segment, self.checks, self.crc = c["segment"], c["checks"], c["crc"]
        self.id_off, self.id_data = c["id_off"], c["id_data"]

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes of its columns (what it holds in memory, or maps)."""
        return sum(a.nbytes for a in self.cols.values())

    def sample_id(self, i: int) -> str:
        return strings(self.id_off, self.id_data, i)

    def checksums(self, i: int) -> dict[str, str] | str | None:
        """Entry i's checksums as the reader takes them: a dict, the event's own text (not hsbuild's own form),
        or None (none recorded)."""
        kind = self.checks[i]
        if kind == CRC32C:
            return {f: f"crc32c:{int(v):08x}" for f, v in zip(FIELDS, self.crc[i], strict=True)}
        if kind == RAW:
            j = int(np.searchsorted(self.cols["raw_pos"], i))
            return strings(self.cols["raw_off"], self.cols["raw_data"], j)
        return None

    def location(self, i: int) -> tuple[str | None, int | None, int | None, dict[str, str] | str | None]:
        """(segment, token_start, num_tokens, checksums) of entry i."""
        start, num = int(self.token_start[i]), int(self.num_tokens[i])
        return (self.segments[self.segment[i]], None if start < 0 else start, None if num < 0 else num,
                self.checksums(i))

    def entry(self, i: int) -> dict:
        if not -self.n <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        i %= self.n
        seg, start, num, ck = self.location(i)
        if isinstance(ck, dict):
            ck = json.dumps(ck, sort_keys=True)  # byte for byte the event's text (TEMPLATE)
        return {"sample_id": self.sample_id(i), "row_idx": int(self.row_idx[i]), "segment": seg,
                "token_start": start, "num_tokens": num, "checksums": ck}

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self.entry(j) for j in range(*i.indices(self.n))]
        return self.entry(int(i))

    def __iter__(self) -> Iterator[dict]:
        return (self.entry(i) for i in range(self.n))

    def sample_ids(self) -> list[str]:
        data, off = self.id_data.tobytes(), self.id_off.tolist()
        return [data[a:b].decode() for a, b in zip(off[:-1], off[1:], strict=True)]

    def position_of_row(self, row: int) -> int | None:
        """The entry of source row `row` (the last, were a row held twice), or None."""
        j = int(np.searchsorted(self.row_idx, row, side="right")) - 1
        return j if j >= 0 and int(self.row_idx[j]) == row else None

    # -- file -------------------------------------------------------------------------------------------------

    def write(self, path: Path) -> int:
        """Write it to `path` (a temp file in the same folder, fsynced, renamed over it); returns its digest."""
        layout, offset = {}, 0
        for name in COLUMNS:
            a = self.cols[name]
            layout[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset}
            offset += -(-a.nbytes // ALIGN) * ALIGN
        payload = bytearray(offset)
        for name, where in layout.items():
            a = np.ascontiguousarray(self.cols[name])
            payload[where["offset"]:where["offset"] + a.nbytes] = a.tobytes()
        digest = crc32c.crc32c(payload)
        header = json.dumps({"version": VERSION, "key": self.key, "n": self.n, "columns": layout,
                             "segments": self.segments, "crc32c": digest}).encode()
        start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
        head = MAGIC + len(header).to_bytes(8, "little") + header
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as f:
                f.write(head + b"\0" * (start - len(head)))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return digest

    @classmethod
    def open(cls, path: Path, key: dict | None = None, digest: int | None = None) -> ReaderIndex:
        """Map the index file `path`. IndexFileError unless it is a whole index of this version made for `key`
        (and, given, with contents of CRC-32C `digest`); OSError when it cannot be read."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC) + 8:
                raise IndexFileError(f"{path}: too short")
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        buf = memoryview(m)
        if bytes(buf[:len(MAGIC)]) != MAGIC:
            raise IndexFileError(f"{path}: not a reader index of this version")
        hlen = int.from_bytes(buf[len(MAGIC):len(MAGIC) + 8], "little")
        try:
            head = json.loads(bytes(buf[len(MAGIC) + 8:len(MAGIC) + 8 + hlen]))
        except ValueError as e:
            raise IndexFileError(f"{path}: header does not parse") from e
        if head.get("version") != VERSION or (key is not None and head.get("key") != key):
            raise IndexFileError(f"{path}: made for another state of the log")
        start = -(-(len(MAGIC) + 8 + hlen) // ALIGN) * ALIGN
        payload = buf[start:]
        if crc32c.crc32c(payload) != head["crc32c"] or (digest is not None and head["crc32c"] != digest):
            raise IndexFileError(f"{path}: contents do not match their checksum")
        cols = {}
        try:
            for name in COLUMNS:
                c = head["columns"][name]
                dt, shape = np.dtype(c["dtype"]), tuple(c["shape"])
                count = int(np.prod(shape))
                a = np.frombuffer(payload, dtype=dt, count=count, offset=c["offset"]).reshape(shape)
                cols[name] = a
        except (KeyError, ValueError, TypeError) as e:
            raise IndexFileError(f"{path}: columns do not match the header ({e})") from e
        return cls(cols, head["segments"], head["key"], Path(path), head["crc32c"])

    def __reduce__(self):
        if self.path is not None and self.keep_file():
            return _reopen, (str(self.path), self.key, self.digest)
        return ReaderIndex, ({k: np.array(v) for k, v in self.cols.items()}, self.segments, self.key)

    def keep_file(self) -> bool:
        """Before a worker maps this index's file: make sure it is there (written again from this process's
        mapping if something removed it), and fresh (its time set to now: the cache's clean-up spares it)."""
        assert self.path is not None
        try:
            os.utime(self.path)
            return True
        except FileNotFoundError:
            pass
        except OSError:
            return False
        try:
            return self.write(self.path) == self.digest
        except OSError:
            return False


def _reopen(path: str, key: dict, digest: int) -> ReaderIndex:
    """A worker's copy of its parent's index: the same file, checked to hold the same contents."""
    return ReaderIndex.open(Path(path), key, digest)
