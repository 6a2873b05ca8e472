"""Reads never trust a decoder: a chunk that decodes to anything but exactly its chunk's bytes is a damaged
sample on every read path, with checksums compared or not.

numcodecs' zstd and blosc decode a shorter frame into a bigger buffer without a word (the rest of the buffer
keeps what it held: `np.empty`'s leftovers), and c-blosc reads past the end of a chunk whose header claims more
compressed bytes than it has. The build tests below craft such chunks in a real build (a valid frame of fewer
values, one of more, a truncated blosc frame, written over a real chunk, the shard's index rewritten to match
so that only the frame is wrong) and read the sample every way hsbuild reads: `SegmentReader` (direct and
through Zarr), `HiddenStateDataset`, a verify sweep."""

from __future__ import annotations

import os
import shutil

import numcodecs
import numpy as np
import pytest
from conftest import ROOMY, random_rows, write_jsonl

from builder.errors import DamagedSampleError
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store.codec import declared_size
from builder.store.direct import FieldLayout, _decode
from builder.store.reader import SegmentReader
from builder.store.segment import field_geometry, sample_files
from builder.store.shard import EMPTY, encode_shard, read_index
from builder.verify.sweep import SweepOptions, run_sweep

TINY = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
CODECS = {"blosc": "blosc-lz4-bitshuffle:5", "zstd": "zstd:1", "none": "none"}
VICTIM = "s0002"


def _raw_frame(data: bytes) -> bytes:
    """A zstd frame that does not say its content size (as a streaming compressor writes): one raw block."""
    return (b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x30]) + ((len(data) << 3) | 1).to_bytes(3, "little") + data)


# -- the decoder's contract, frame by frame -------------------------------------------------------------------


ROW = np.arange(256, dtype=np.uint16)  # one chunk's values
BLOSC = numcodecs.Blosc(cname="lz4", shuffle=2, typesize=2, clevel=5)
ZSTD = numcodecs.Zstd(level=1)


def _try(codec, frame: bytes) -> np.ndarray | DamagedSampleError:
    dst = np.full(ROW.shape, 0xDEAD, dtype=np.uint16)
    err = _decode(codec, memoryview(frame), dst, "f/c.0.0", "seg-x", "hidden_state")
    return err if err is not None else dst


@pytest.mark.parametrize("codec", [BLOSC, ZSTD], ids=["blosc", "zstd"])
def test_a_frame_decodes_to_exactly_its_chunk_or_is_damage(codec):
    assert np.array_equal(_try(codec, bytes(codec.encode(ROW))), ROW)
    assert declared_size(codec, bytes(codec.encode(ROW))) == ROW.nbytes
    for bad in (ROW[:100], ROW[:1], np.arange(300, dtype=np.uint16)):  # shorter, much shorter, longer
        got = _try(codec, bytes(codec.encode(bad)))
        assert isinstance(got, DamagedSampleError) and got.reason == "unreadable", (len(bad), got)
        assert "hidden_state" in str(got)


def test_frames_that_do_not_say_their_size_are_decoded_apart_and_measured():
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    good = {
        "streamed": _raw_frame(ROW.tobytes()),
        "two frames": bytes(ZSTD.encode(ROW[:100])) + bytes(ZSTD.encode(ROW[100:])),
        "skippable first": skippable + bytes(ZSTD.encode(ROW)),
    }
    for name, frame in good.items():
        assert np.array_equal(_try(ZSTD, frame), ROW), name
    bad = {
        "streamed, short": _raw_frame(ROW[:100].tobytes()),
        "streamed, long": _raw_frame(np.arange(300, dtype=np.uint16).tobytes()),
        "skippable, then short": skippable + bytes(ZSTD.encode(ROW[:10])),
        "exact, then more": bytes(ZSTD.encode(ROW)) + bytes(ZSTD.encode(ROW[:5])),
        "exact, then garbage": bytes(ZSTD.encode(ROW)) + b"garbage",
        "truncated": bytes(ZSTD.encode(ROW))[:-9],
    }
    for name, frame in bad.items():
        got = _try(ZSTD, frame)
        assert isinstance(got, DamagedSampleError) and got.reason == "unreadable", name


def test_a_truncated_blosc_chunk_is_damage_not_an_overread():
    """c-blosc trusts its header's compressed size: given half a chunk it reads on past the buffer's end."""
    whole = bytes(BLOSC.encode(np.random.default_rng(0).integers(0, 60000, ROW.size).astype(np.uint16)))
    for frame in (whole[: len(whole) // 2], whole[:15], whole + b"\0\0"):
        got = _try(BLOSC, frame)
        assert isinstance(got, DamagedSampleError) and got.reason == "unreadable", len(frame)


# -- every read path of a real build ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """One real build per codec (6 samples; s0002 of 300 tokens spans several chunks), made once."""
    root = tmp_path_factory.mktemp("short-decode")
    rows = random_rows(6, seed=5, lo=20, hi=90)
    rows[2]["input_ids"] = (rows[2]["input_ids"] * 20)[:300]
    rows[2]["loss_mask"] = [0] * 100 + [1] * 200
    src = write_jsonl(root / "source.jsonl", rows)
    out = {}
    for name, spec in CODECS.items():
        lay = init_build(root / name, src, watermarks=ROOMY, model=TINY, codec=spec, chunk_tokens=64)
        assert run_build(lay.root, RunOptions(), echo=lambda m: None).exit_code == 0
        out[name] = lay.root
    return out


def _live(build) -> dict[str, dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return {r["sample_id"]: r for r in log.samples()}


def _rewrite_chunk(build, row: dict, fld: str, which: int, frame_of) -> None:
    """Replace the `which`-th inner chunk of the sample in its (first) shard file by `frame_of(values, codec)`,
    and write the shard again whole with an index (and CRC) that match: only the frame itself is wrong."""
    seg_dir = layout(build).data / row["segment"]
    shard = sample_files(seg_dir, fld, row["token_start"], row["num_tokens"])[0]
    ct, sc = field_geometry(seg_dir, fld)
    lay = FieldLayout.of(seg_dir, fld)
    idx = read_index(shard, sc)
    whole = shard.read_bytes()
    chunks = [None if int(o) == EMPTY else whole[int(o) : int(o) + int(n)] for o, n in idx.tolist()]
    k = (row["token_start"] // ct) % sc + which
    width = lay.width or 1
    values = np.frombuffer(lay.codec.decode(chunks[k]) if lay.codec else chunks[k], dtype=lay.dtype)
    assert values.size == ct * width
    chunks[k] = frame_of(values.reshape(ct, width) if lay.width else values, lay)
    os.chmod(shard, 0o644)
    shard.unlink()
    shard.write_bytes(encode_shard(chunks))


def _encode(a: np.ndarray, lay: FieldLayout) -> bytes:
    a = np.ascontiguousarray(a)
    if lay.codec is None:
        return a.tobytes()
    if isinstance(lay.codec, numcodecs.Blosc):
        return bytes(numcodecs.Blosc(cname="lz4", shuffle=2, typesize=a.dtype.itemsize, clevel=5).encode(a))
    return bytes(numcodecs.Zstd(level=1).encode(a))


DAMAGES = {
    "short": lambda v, lay: _encode(v[: len(v) // 2], lay),  # a valid frame of half the tokens
    "one value short": lambda v, lay: _encode(v.reshape(-1)[:-1], lay),
    "long": lambda v, lay: _encode(np.concatenate([v, v[:3]]), lay),
    "truncated": lambda v, lay: _encode(v, lay)[:-7],  # the right values, cut short (blosc would read on)
}


def _reads(build, item: int, monkeypatch) -> dict[str, object]:
    """Read the sample every way hsbuild reads: the outcome of each (the data, or the error raised)."""
    row = _live(build)[VICTIM]
    args = (row["segment"], row["token_start"], row["num_tokens"], row["checksums"])
    out: dict[str, object] = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except DamagedSampleError as e:
            out[name] = e

    for checked in (False, True):
        attempt(f"direct checked={checked}", lambda c=checked: SegmentReader(layout(build).data, c).read(*args))
        attempt(f"dataset checked={checked}",
                lambda c=checked: HiddenStateDataset(build, verify_checksums=c)[item])
        with monkeypatch.context() as m:  # the same reader through Zarr (its path for layout 1 segments)
            m.setattr(SegmentReader, "_direct", lambda self, seg: None)
            attempt(f"zarr checked={checked}", lambda c=checked: SegmentReader(layout(build).data, c).read(*args))
    return out


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_read_path_refuses_a_chunk_of_the_wrong_size(builds, codec, damage, tmp_path, monkeypatch):
    build = shutil.copytree(builds[codec], tmp_path / "b", ignore=shutil.ignore_patterns(".ballast", "*.sock"))
    rows = _live(build)
    item = sorted(rows, key=lambda s: rows[s]["row_idx"]).index(VICTIM)
    assert rows[VICTIM]["num_tokens"] > 3 * 64  # several chunks: the damaged one is not the sample's last
    before = _reads(build, item, monkeypatch)
    assert not any(isinstance(v, Exception) for v in before.values()), before

    _rewrite_chunk(build, rows[VICTIM], "hidden_state", 1, DAMAGES[damage])
    for path, got in _reads(build, item, monkeypatch).items():
        assert isinstance(got, DamagedSampleError), (path, type(got))
        assert got.reason in ("unreadable", "checksum_mismatch") and got.field == "hidden_state", (path, got)
        if "checked=False" in path:
            assert got.reason == "unreadable", (path, got)  # caught without a checksum
        if path.startswith("dataset"):
            assert got.sample_id == VICTIM and f"hsbuild resume {build}" in str(got), (path, got)
    # the other samples read as before; verify condemns exactly the damaged one
    ds = HiddenStateDataset(build, verify_checksums=False)
    for i in range(len(ds)):
        if i != item:
            ds[i]
    s = run_sweep(build, SweepOptions(), echo=lambda m: None)
    assert [(d.sample_id, d.reason) for d in s.damaged] == [(VICTIM, "unreadable")], s.damaged
