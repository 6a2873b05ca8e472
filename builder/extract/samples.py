"""A source's samples held columnar: one Arrow array of ids, one of fingerprints, numpy arrays of rows and token
counts, and every sample's tokens and loss mask in two flat buffers (int32 and uint8) with per-sample starts.

A source of a million rows is a handful of arrays, not a million Python objects: about 40 bytes a row plus the
id's characters, and 5 bytes a token (4 of the token id, 1 of the loss mask). A `Sample` (its tokens and mask
views into the buffers, no copy) is made only when one is asked for (indexing, iteration): every consumer reads
the source as a sequence of Samples so far.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import pyarrow as pa

FINGERPRINT_BYTES = 8
ITER_CHUNK = 4096
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass
class Sample:
    sample_id: str
    row: int
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]
    fingerprint: str
    conversation: str | None = None  # a regenerating build: its messages (extract/prompts.py `dump`)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def fingerprint(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    h.update(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def with_conversations(fps: pa.StringArray, conversations: pa.StringArray) -> pa.StringArray:
    """A regenerating build's fingerprints: each of its tokens and mask (`fingerprints`) and of its conversation,
    whose later turns its first prompt does not hold (a changed turn is a changed row, as a changed token is)."""
    out = []
    for fp, conv in zip(fps.to_pylist(), conversations.to_pylist(), strict=True):
        h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
        h.update(fp.encode())
        h.update(b"|")
        h.update((conv or "").encode())
        out.append(h.hexdigest())
    return pa.array(out, pa.string())


def fingerprints(tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.StringArray:
    """`fingerprint` of every sample of the flat buffers, as one Arrow string array (no Python string a row)."""
    n = len(starts)
    digests = bytearray(n * FINGERPRINT_BYTES)
    ids_view = memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B")
    mask_view = memoryview(np.ascontiguousarray(mask, dtype=np.uint8)).cast("B")
    blake2b = hashlib.blake2b
    for i, (s, k) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        h = blake2b(digest_size=FINGERPRINT_BYTES)
        h.update(ids_view[4 * s : 4 * (s + k)])
        h.update(b"|")
        h.update(mask_view[s : s + k])
        digests[i * FINGERPRINT_BYTES : (i + 1) * FINGERPRINT_BYTES] = h.digest()
    return hex_strings(np.frombuffer(digests, dtype=np.uint8), FINGERPRINT_BYTES)


def hex_strings(data: np.ndarray, width: int) -> pa.StringArray:
    """Bytes (uint8, `width` a string) as lower-case hex strings, like `bytes.hex()`."""
    n = len(data) // width if width else 0
    out = np.empty(2 * len(data), dtype=np.uint8)
    out[0::2] = _HEX[data >> 4]
    out[1::2] = _HEX[data & 15]
    offsets = np.arange(0, 2 * width * (n + 1), 2 * width, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(out))


class SourceSamples(Sequence[Sample]):
    """A source's samples (or a selection of them, in any order), columnar. Index or iterate it for `Sample`s;
    `rows` and `num_tokens` hold those of all of them at once."""

    __slots__ = ("_ids", "_fps", "rows", "starts", "num_tokens", "tokens", "mask", "conversations")

    def __init__(self, sample_ids: pa.Array, fingerprints: pa.Array, rows: np.ndarray, starts: np.ndarray,
                 num_tokens: np.ndarray, tokens: np.ndarray, mask: np.ndarray,
                 conversations: pa.Array | None = None):
        n = len(sample_ids)
        if not (len(fingerprints) == len(rows) == len(starts) == len(num_tokens) == n):
            raise ValueError("SourceSamples: columns of different lengths")
        if tokens.shape != mask.shape:
            raise ValueError("SourceSamples: tokens and mask buffers of different lengths")
        self._ids = _strings(sample_ids)
        self._fps = _strings(fingerprints)
        self.rows = np.asarray(rows, dtype=np.int64)  # the row of the source file (0-based)
        self.starts = np.asarray(starts, dtype=np.int64)  # where a sample's tokens start in `tokens` / `mask`
        self.num_tokens = np.asarray(num_tokens, dtype=np.int64)
        self.tokens = tokens  # int32, flat
        self.mask = mask  # uint8, flat
        # a regenerating build's: each sample's messages as JSON (its tokens are its first prompt); else None
        self.conversations = None if conversations is None else _strings(conversations)
        if self.conversations is not None and len(self.conversations) != n:
            raise ValueError("SourceSamples: conversations of another length")

    # -- the columns -----------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    def registry_columns(self) -> dict[str, pa.Array]:
        """What `EventLog.register_samples` records of each sample, as columns."""
        return {"sample_id": self._ids, "row_idx": pa.array(self.rows, pa.int64()), "fingerprint": self._fps,
                "num_tokens": pa.array(self.num_tokens, pa.int64())}

    # -- selections --------------------------------------------------------------------------------------------
    def take(self, indices: np.ndarray | Sequence[int]) -> SourceSamples:
        """These samples at `indices` (in that order); the token buffers are shared, not copied."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError("SourceSamples.take: index out of range")
        idx = np.where(idx < 0, idx + len(self), idx)
        at = pa.array(idx, pa.int64())
        return SourceSamples(self._ids.take(at), self._fps.take(at), self.rows[idx], self.starts[idx],
                             self.num_tokens[idx], self.tokens, self.mask,
                             None if self.conversations is None else self.conversations.take(at))

    # -- Sequence[Sample] ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> SourceSamples: ...

    def __getitem__(self, i: int | slice) -> Sample | SourceSamples:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of {n}")
        i = int(i) % n if n else int(i)
        s, k = int(self.starts[i]), int(self.num_tokens[i])
        return Sample(self._ids[i].as_py(), int(self.rows[i]), self.tokens[s : s + k], self.mask[s : s + k],
                      self._fps[i].as_py(), None if self.conversations is None else self.conversations[i].as_py())

    def at(self, positions: list[int] | np.ndarray) -> list[Sample]:
        """The samples at these positions, made in bulk (a plan's samples to do: tens of thousands of them)."""
        at = np.asarray(positions, dtype=np.int64)
        if not at.size:
            return []
        n = len(self)
        if at.min() < -n or at.max() >= n:
            raise IndexError(f"sample positions outside 0..{n - 1}")
        at = at % n
        idx = pa.array(at)
        ids, fps = self._ids.take(idx).to_pylist(), self._fps.take(idx).to_pylist()
        convs = [None] * len(ids) if self.conversations is None else self.conversations.take(idx).to_pylist()
        return [Sample(sid, row, self.tokens[s : s + k], self.mask[s : s + k], fp, conv)
                for sid, fp, row, s, k, conv in zip(ids, fps, self.rows[at].tolist(), self.starts[at].tolist(),
                                                    self.num_tokens[at].tolist(), convs, strict=True)]

    def __iter__(self) -> Iterator[Sample]:
        for a in range(0, len(self), ITER_CHUNK):  # a chunk's ids at once: cheaper than scalar conversions
            b = a + ITER_CHUNK
            ids, fps = self._ids[a:b].to_pylist(), self._fps[a:b].to_pylist()
            convs = [None] * len(ids) if self.conversations is None else self.conversations[a:b].to_pylist()
            for sid, fp, row, s, k, conv in zip(ids, fps, self.rows[a:b].tolist(), self.starts[a:b].tolist(),
                                                self.num_tokens[a:b].tolist(), convs, strict=True):
                yield Sample(sid, row, self.tokens[s : s + k], self.mask[s : s + k], fp, conv)

    def __repr__(self) -> str:
        return f"SourceSamples({len(self)} samples, {self.total_tokens} tokens)"


def _strings(a: pa.Array | pa.ChunkedArray) -> pa.StringArray:
    if isinstance(a, pa.ChunkedArray):
        a = a.combine_chunks()
    if a.type != pa.string():
        a = a.cast(pa.string())
    return a
