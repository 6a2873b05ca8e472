"""Written data leaves the page cache: once a group's shard files are durable, their cached pages are dropped
(posix_fadvise DONTNEED), so a build's terabytes do not crowd out what the machine reads (the model, the
engine) or count against a container's memory limit; the samples still read back bit-exact, from the device.

Residency is read with mincore(2) on a private mapping of each file (ctypes; Linux)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from builder.store.reader import SegmentReader
from builder.store.segment import SegmentWriter, init_data_group

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "posix_fadvise"),
                                reason="mincore(2) and posix_fadvise: Linux only")
PAGE = mmap.PAGESIZE


def resident(path: Path) -> float:
    """The fraction of `path`'s pages in the page cache."""
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        vec = ctypes.create_string_buffer(pages)
        start = ctypes.c_char.from_buffer(mm)
        try:
            if libc.mincore(ctypes.addressof(start), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del start
        return sum(b & 1 for b in vec.raw) / pages


def write_fsynced(path: Path, data: bytes, drop: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_durable_group_leaves_the_page_cache_and_reads_back(tmp_path):
    data = os.urandom(4 << 20)
    write_fsynced(tmp_path / "kept", data, drop=False)
    write_fsynced(tmp_path / "dropped", data, drop=True)
    if resident(tmp_path / "kept") < 0.5 or resident(tmp_path / "dropped") > 0.1:
        pytest.skip(f"this filesystem's page cache does not show a write or does not take the advice "
                    f"(kept {resident(tmp_path / 'kept'):.2f}, dropped {resident(tmp_path / 'dropped'):.2f})")

    import torch  # noqa: PLC0415

    root = tmp_path / "data"
    init_data_group(root, {})
    w = SegmentWriter(root, "seg-a", 256, 3, 64, "none").create()
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        n = 500 + 37 * i
        ids = np.arange(n, dtype=np.int32)
        aux = torch.randn(n, 3 * 256, generator=g).to(torch.bfloat16)
        final = torch.randn(n, 256, generator=g).to(torch.bfloat16)
        w.add(ids, np.ones(n, dtype=np.uint8), aux, final, sample_id=f"s{i}")
        samples.append((ids, aux, final))
    locs = w.flush()

    shards = [p for p in w.path.rglob("c.*") if p.is_file()]
    assert sum(p.stat().st_size for p in shards) > 4 << 20  # a few MB written: the states, uncompressed
    cached = {p.relative_to(w.path).as_posix(): round(resident(p), 2) for p in shards}
    assert all(v == 0 for v in cached.values()), cached

    reader = SegmentReader(root)
    for (ids, aux, final), loc in zip(samples, locs, strict=True):
        got = reader.read("seg-a", loc.token_start, loc.num_tokens, loc.checksums)
        assert np.array_equal(got["input_ids"].numpy(), ids)
        assert torch.equal(got["aux_hidden_state"].view(torch.int16), aux.view(torch.int16))
        assert torch.equal(got["hidden_state"].view(torch.int16), final.view(torch.int16))
