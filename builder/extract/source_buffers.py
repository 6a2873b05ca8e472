"""A source's tokens and loss masks as they are read, batch after batch: in memory up to a bound, then in two
unlinked temporary files mapped at the end, so that what a large source holds in memory is its ids and counts,
and its tokens are pages of a file (builder/extract/source.py, SPILL_BYTES)."""

from __future__ import annotations

import tempfile

import numpy as np


class TokenBuffers:
    """Every sample's tokens (int32) and mask (uint8), batch after batch: in memory up to `spill_bytes`, then
    in two unlinked temporary files (TMPDIR), mapped copy-on-write by `finish`. Nothing is left on disk: the
    files have no name and go with the mapping. Where TMPDIR cannot take them (full, missing) everything stays
    in memory, as before spilling existed."""

    def __init__(self, spill_bytes: int):
        self.spill_bytes = spill_bytes
        self.tokens: list[np.ndarray] = []  # parts not in the files
        self.masks: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []
        self.count = 0  # tokens so far
        self.spilled = 0  # tokens in the files
        self.files: tuple | None = None
        self.memory_only = False

    def add(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> None:
        self.starts.append(starts + self.count)
        self.tokens.append(np.ascontiguousarray(tokens, dtype=np.int32))
        self.masks.append(np.ascontiguousarray(mask, dtype=np.uint8))
        self.count += tokens.shape[0]
        if self.files is None and not self.memory_only and self.count * 5 > self.spill_bytes:
            try:
                self.files = (tempfile.TemporaryFile(prefix="hsbuild-source-tokens-", buffering=0),
                              tempfile.TemporaryFile(prefix="hsbuild-source-mask-", buffering=0))
            except OSError:
                self.memory_only = True
        if self.files is not None:
            self._spill()

    def _spill(self) -> None:
        assert self.files is not None
        try:
            while self.tokens:
                for f, a in zip(self.files, (self.tokens[0], self.masks[0]), strict=True):
                    view = memoryview(a).cast("B")
                    while view:
                        view = view[f.write(view):]
                self.spilled += self.tokens.pop(0).shape[0]
                self.masks.pop(0)
        except OSError:  # TMPDIR is full: read back what is there, hold everything in memory from now on
            back = []
            for f, dtype in zip(self.files, (np.int32, np.uint8), strict=True):
                f.seek(0)
                back.append(np.fromfile(f, dtype=dtype, count=self.spilled))
            self.tokens.insert(0, back[0])
            self.masks.insert(0, back[1])
            self.spilled = 0
            self.close()
            self.memory_only = True

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)
        if self.files is None:
            return _joined(self.tokens, np.int32), _joined(self.masks, np.uint8), starts
        # copy-on-write: writable arrays for torch, never written back
        tokens = np.memmap(self.files[0], dtype=np.int32, mode="c", shape=(self.count,))
        mask = np.memmap(self.files[1], dtype=np.uint8, mode="c", shape=(self.count,))
        return tokens, mask, starts

    def close(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.close()  # a mapping made by finish keeps its file until it is gone
            self.files = None


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
