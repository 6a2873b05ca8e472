"""The reader's index from the rows of a snapshot of the log (builder/reader/snapshot.py), by columns: numpy over
Arrow buffers, never a Python object per sample.

A snapshot's rows carry each entry's checksums in two columns: `digits`, the 32 hex digits of hsbuild's own text
(TEMPLATE: the four `crc32c:` values, FIELDS order) where the event's text is that template with exactly one
character in each digit, and `raw`, the text itself otherwise (NULL both: no checksums recorded). Digits that
are all lowercase hex become numbers (CRC32C); any other digits give the text back (the template with them:
byte for byte the event's) as RAW.
"""

from __future__ import annotations

import numpy as np

from builder.reader.index import CRC32C, NO_CHECKSUMS, RAW, SLOTS, TEMPLATE, ReaderIndex

DIGITS = 8 * len(SLOTS)
_H, _L = np.uint64(0x8080808080808080), np.uint64(0x0101010101010101)


def _at_least(w: np.ndarray, k: int) -> np.ndarray:
    """Per byte of each word (bytes below 0x80): bit 7 set where the byte is >= k."""
    return ((w | _H) - np.uint64(k) * _L) & _H


def hex8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight ASCII characters per little-endian word, read as a hex number written most significant digit
    first: (whether all eight are lowercase hex digits, the number). Word-wide arithmetic, no per-byte table."""
    low = (w & _H) == 0
    digit = _at_least(w, 0x30) & ~_at_least(w, 0x3A)
    letter = _at_least(w, 0x61) & ~_at_least(w, 0x67)
    ok = low & ((digit | letter) == _H)
    v = (w & np.uint64(0x0F0F0F0F0F0F0F0F)) + np.uint64(9) * ((w >> np.uint64(6)) & _L)  # each byte: its digit
    v = ((v << np.uint64(4)) | (v >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)  # pairs of digits: bytes
    v = ((v << np.uint64(8)) | (v >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)  # pairs of bytes
    v = ((v << np.uint64(16)) | (v >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    return ok, v.astype(np.uint32)


def offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def with_digits(digits: bytes) -> bytes:
    """TEMPLATE with these 32 characters in its digits."""
    text = bytearray(TEMPLATE)
    for j, s in enumerate(SLOTS):
        text[s:s + 8] = digits[8 * j:8 * j + 8]
    return bytes(text)


def checksum_columns(has_digits: np.ndarray, digits: np.ndarray, raw_valid: np.ndarray, raw_off: np.ndarray,
                     raw_data: np.ndarray) -> dict[str, np.ndarray]:
    """`checks`, `crc` and the RAW entries' texts. `digits`: the 32 characters of each entry `has_digits` marks,
    in order (uint8, 32 a row); `raw_*`: the texts of the entries `raw_valid` marks, in order (offsets into
    `raw_data`, one more than there are texts)."""
    n = len(has_digits)
    checks = np.where(raw_valid, RAW, NO_CHECKSUMS).astype(np.uint8)
    crc = np.zeros((n, len(SLOTS)), dtype=np.uint32)
    rows = np.flatnonzero(has_digits)
    words = np.frombuffer(np.ascontiguousarray(digits).tobytes(), dtype="<u8").reshape(len(rows), len(SLOTS))
    good, values = hex8(words)
    ok = good.all(axis=1)
    crc[rows[ok]] = values[ok]
    checks[rows[ok]] = CRC32C
    raw_pos = np.flatnonzero(raw_valid).astype(np.int64)
    raw_off = np.asarray(raw_off, dtype=np.int64)
    raw_data = np.asarray(raw_data, dtype=np.uint8)
    if not ok.all():  # digits that are not all lowercase hex: the event's text is kept as it is (rare)
        bad = rows[~ok]
        texts = {int(p): raw_data[a:b].tobytes() for p, a, b in zip(raw_pos, raw_off[:-1], raw_off[1:], strict=True)}
        for p, d in zip(bad.tolist(), np.asarray(digits).reshape(len(rows), DIGITS)[~ok], strict=True):
            texts[p] = with_digits(d.tobytes())
        checks[bad] = RAW
        raw_pos = np.array(sorted(texts), dtype=np.int64)
        raw_off = offsets(np.array([len(texts[p]) for p in raw_pos.tolist()], dtype=np.int64))
        raw_data = np.frombuffer(b"".join(texts[p] for p in raw_pos.tolist()), dtype=np.uint8)
    return {"checks": checks, "crc": crc, "raw_pos": raw_pos, "raw_off": raw_off - raw_off[0],
            "raw_data": raw_data[raw_off[0]:raw_off[-1]].copy()}


def _array(col):
    """One Arrow array of a table's column (its chunks combined)."""
    import pyarrow as pa  # noqa: PLC0415

    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _valid(arr) -> np.ndarray:
    """Not NULL, per entry (from the validity bitmap: no pyarrow.compute, which imports pandas)."""
    n = len(arr)
    bitmap = arr.buffers()[0]
    if arr.null_count == 0 or bitmap is None:
        return np.ones(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[arr.offset:arr.offset + n].astype(bool)


def _strings(col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64, data uint8, valid bool) of an Arrow string column; a NULL entry is empty."""
    import pyarrow as pa  # noqa: PLC0415

    arr = _array(col)
    if arr.type != pa.large_string():
        arr = arr.cast(pa.large_string())
    n = len(arr)
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int64, count=n + 1, offset=arr.offset * 8) if n else np.zeros(1, np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    start = int(off[0])
    return off - start, data[start:int(off[-1])], _valid(arr)


def _ints(col) -> np.ndarray:
    """An Arrow column of signed integers as int64, NULL as -1 (from its buffers: no pyarrow.compute or
    to_numpy, which import pandas)."""
    arr = _array(col)
    n = len(arr)
    size = arr.type.bit_width // 8
    values = (np.frombuffer(arr.buffers()[1], dtype=f"<i{size}", count=n, offset=arr.offset * size) if n
              else np.zeros(0, np.int64)).astype(np.int64)
    return np.where(_valid(arr), values, -1) if arr.null_count else values


def from_arrow(table, key: dict) -> ReaderIndex:
    """The index of a snapshot's rows (snapshot.rows_sql, in order), from the file or a live owner."""
    seg = _array(table["segment"]).dictionary_encode()
    names: list[str | None] = seg.dictionary.to_pylist()
    codes = np.where(_valid(seg.indices), _ints(seg.indices), len(names)).astype(np.uint32)
    if seg.null_count:
        names.append(None)
    id_off, id_data, _ = _strings(table["sample_id"])
    d_off, d_data, d_valid = _strings(table["digits"])
    r_off, r_data, r_valid = _strings(table["raw"])
    if np.any(np.diff(d_off)[d_valid] != DIGITS):
        raise ValueError("the snapshot's digits are not 32 characters each")
    raw_off = np.append(r_off[:-1][r_valid], r_off[-1])
    cols = {"row_idx": _ints(table["row_idx"]), "token_start": _ints(table["token_start"]),
            "num_tokens": _ints(table["num_tokens"]), "segment": codes, "id_off": id_off.copy(),
            "id_data": id_data.copy(), **checksum_columns(d_valid, d_data, r_valid, raw_off, r_data)}
    return ReaderIndex(cols, names, key)
