"""An export at the filesystem's speed (issue 44, point 5) writes what a one-file-at-a-time export wrote: torch.save's
own bytes (`torchfile.save_bytes` keeps torch.save's pickle per signature and checks it), the samples read a batch
at a time give what reading each alone gives (damage included), and its sample files written side by side are
vouched for by the journal only once durable: a power cut at any moment leaves every file the journal vouches for
whole (lazyfs, --dirs strict), and the next run finishes the export with the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from test_export import flip_byte

from builder.errors import DamagedSampleError
from builder.exchange.export import JOURNAL, ExportOptions, export_build
from builder.exchange.export_files import file_digest
from builder.formats import torchfile
from builder.formats.base import Streamed
from builder.layout import layout
from builder.log.events import EventLog
from builder.run.coordinator import RunOptions, run_build
from builder.store.reader import SegmentReader


def _rec(n: int, seed: int, sid: str | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    r: dict = {"input_ids": torch.randint(0, 1000, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.long),
               "aux": torch.randn(1, n, 12, generator=g).bfloat16(), "final": torch.randn(n, 4, generator=g)}
    if sid is not None:
        r["conversation_id"] = sid
    return r


def test_save_bytes_are_torch_saves_bytes():
    """Every shape of dict an export saves (tensors of every length, a string value of any length, empty tensors,
    and what is not a flat dict of tensors) gives torch.save's bytes, first of its kind or not; the kept pickles
    are in use (the signatures checked)."""
    before = len(torchfile._CHECKED)
    for i in range(12):
        for obj in (_rec(3 + i % 3, i), _rec(5, i, "conv-" + "é" * i), _rec(0, i), {"d2t": torch.arange(i)},
                    {str(k): k for k in range(i)}, {"a": torch.arange(4)[1:]}, {"x": [torch.ones(2)]}):
            assert torchfile.save_bytes(obj) == torchfile.torch_save_bytes(_copies(obj)), (i, obj)
    assert len(torchfile._CHECKED) >= before + 6


def _copies(obj: object) -> object:
    """`obj` with every tensor a contiguous copy of its own: what an export saved before it took whole tensors as
    they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().contiguous().clone()
    return {k: _copies(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


def test_tensors_taken_as_they_are_give_the_bytes_of_copies():
    """`save_bytes` copies only the tensors whose bytes would differ uncopied (a view into a bigger storage, a
    transposed one, a storage two values share): its bytes are those of a copy of every tensor, for the fast way
    and torch.save's alike. The whole tensors are not copied (the point: no copy of every array of every file)."""
    import numpy as np

    base = torch.arange(24, dtype=torch.int32)
    arr = np.arange(40, dtype=np.int16)
    whole = torch.randn(3, 4)
    shapes = [{"whole": whole, "again": whole, "view": whole.unsqueeze(0)},  # one storage, three values
              {"slice": base[4:10], "t": base.view(4, 6).t(), "head": base[:6]},  # views of a bigger storage
              {"np": torch.from_numpy(arr[8:16]).view(torch.bfloat16), "np2": torch.from_numpy(arr[8:16])},
              {"big": torch.randn(300, 1024).bfloat16(), "ids": torch.arange(300)},  # over FAST_MAX_BYTES: torch.save
              {"empty": torch.empty(0), "empty2": torch.empty(0, 3), "conj": torch.randn(2, dtype=torch.cfloat).conj()}]
    for _ in range(3):  # first of its signature (torch.save's), checked, then the kept pickle
        for obj in shapes:
            assert torchfile.save_bytes(obj) == torchfile.torch_save_bytes(_copies(obj)), obj
    taken = torchfile._contiguous(shapes[0])
    assert taken["whole"].data_ptr() == whole.data_ptr()  # (not copied)
    assert taken["again"].data_ptr() != whole.data_ptr() and taken["view"].data_ptr() != whole.data_ptr()


def test_a_kept_pickle_that_differs_goes_back_to_torch_save(monkeypatch):
    """Where the fast bytes would differ from torch.save's (another torch), torch.save's are written, and that
    signature is not taken the fast way again."""
    monkeypatch.setattr(torchfile, "_fast", lambda kept, obj: b"not torch.save's bytes")
    first, second, third = (_rec(7, s, "x" * 33) | {"odd": torch.zeros(3, 5)} for s in (1, 2, 3))
    for obj in (first, second, third):
        assert torchfile.save_bytes(obj) == torchfile.torch_save_bytes(obj)
    assert torchfile._signature(first) in torchfile._PICKLES and torchfile._PICKLES[torchfile._signature(first)] is None


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """30 small samples, final state after the norm, run with the built-in model."""
    from conftest import ROOMY, random_rows, write_jsonl

    from builder.run.create import init_build

    base = tmp_path_factory.mktemp("batched")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSBUILD_CACHE_DIR", str(base / "cache"))
        src = write_jsonl(base / "source.jsonl", random_rows(30, seed=4))
        build = init_build(base / "b", src, model="builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,"
                           "intermediate=128", watermarks=ROOMY, final_state="post_norm").root
        assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 30
    return build


def _rows(build: Path) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts("SELECT sample_id, segment, token_start, num_tokens, checksums FROM samples "
                               "ORDER BY row_idx")


def _same(a: dict | DamagedSampleError, b: dict | DamagedSampleError) -> bool:
    if isinstance(a, DamagedSampleError) or isinstance(b, DamagedSampleError):
        return type(a) is type(b) and a.reason == b.reason and str(a) == str(b)  # type: ignore[union-attr]
    return set(a) == set(b) and all(
        (x := a[f]).dtype == (y := b[f]).dtype and x.shape == y.shape
        and (torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if isinstance(x, torch.Tensor)
             else (x == y).all()) for f in a)


def _alone(reader: SegmentReader, it: tuple, **kw) -> dict | DamagedSampleError:
    try:
        return reader.read(*it) if kw.get("tensors", True) else reader.read_raw(*it, fields=kw["fields"])
    except DamagedSampleError as e:
        return e


def test_read_many_gives_what_each_read_gives(built, tmp_path):
    """Read together, each sample is what `read` gives it alone; a damaged one (a flipped byte: only its
    CRC-32C tells) raises the same damage, and its neighbours still read whole."""
    import shutil

    build = tmp_path / "copy"
    shutil.copytree(built, build)
    rows = _rows(build)
    flip_byte(build, rows[7], "aux_hidden_state")
    items = [(r["segment"], r["token_start"], r["num_tokens"], r["checksums"]) for r in rows]
    alone = [_alone(SegmentReader(layout(build).data), it) for it in items]
    assert isinstance(alone[7], DamagedSampleError) and sum(isinstance(a, DamagedSampleError) for a in alone) == 1
    many = SegmentReader(layout(build).data).read_many(items[::-1])[::-1]
    assert all(_same(a, m) for a, m in zip(alone, many, strict=True))
    fields = ("input_ids", "loss_mask")
    raw = SegmentReader(layout(build).data).read_many(items, fields=fields, tensors=False)
    assert all(_same(_alone(SegmentReader(layout(build).data), it, tensors=False, fields=fields), m)
               for it, m in zip(items, raw, strict=True))


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_exported_files_are_torch_saves_bytes(built, tmp_path, fmt, streamed, monkeypatch):
    """Each sample file is, byte for byte, torch.save of what it holds (the trainer's own loop would write it), and
    the journal's checksum and size are the file's: made in memory, or (`streamed`: what a sample over
    FAST_MAX_BYTES is, here every one) torch.save straight into the file, its CRC-32C made as it is written."""
    if streamed:
        monkeypatch.setattr(torchfile, "FAST_MAX_BYTES", 0)
        made = []
        monkeypatch.setattr(torchfile, "Streamed", lambda size, write: made.append(size) or Streamed(size, write))
    out = tmp_path / "out"
    rep = export_build(built, out, ExportOptions(format=fmt))
    assert rep.complete and rep.exported == 30
    files = [p for p in out.rglob("*") if p.is_file() and p.name != JOURNAL and zipfile.is_zipfile(p)
             and ("data_" in p.name or fmt == "modelopt")]
    assert len(files) == 30
    for p in files:
        assert p.read_bytes() == torchfile.torch_save_bytes(torch.load(p, weights_only=True)), p
    vouched = json.loads((out / JOURNAL).read_text())["files"]
    for path, _fp, digest, size in vouched.values():
        assert file_digest(out / path) == digest and (out / path).stat().st_size == size, path
    assert rep.bytes_written == sum(p.stat().st_size for p in files)
    if streamed:
        assert len(made) == 30 and all(s >= p.stat().st_size for s, p in zip(sorted(made), sorted(
            files, key=lambda p: p.stat().st_size), strict=True))  # (the watermarks counted at least its bytes)


def test_an_export_whose_journal_holds_blake2b_sums_is_checked_by_them(built, tmp_path):
    """A journal written before the CRC-32C (each file's checksum a blake2b-128) is read as it was: a re-run keeps
    every whole file (not read again for its states, not rewritten), finds the one damaged since by its blake2b
    and writes it again (repaired), and vouches for the new file by its CRC-32C."""
    import hashlib

    out = tmp_path / "out"
    assert export_build(built, out, ExportOptions(format="specforge")).exported == 30
    j = json.loads((out / JOURNAL).read_text())
    for en in j["files"].values():
        en[2] = hashlib.blake2b((out / en[0]).read_bytes(), digest_size=16).hexdigest()
    for rel, v in j["finish"]["files"].items():
        v[0] = hashlib.blake2b((out / rel).read_bytes(), digest_size=16).hexdigest()
    (out / JOURNAL).write_text(json.dumps(j))
    sid, (path, *_) = sorted(j["files"].items())[3]
    data = bytearray((out / path).read_bytes())
    data[-100] ^= 0xFF  # (inside the zip's central directory: same size, other bytes)
    (out / path).write_bytes(bytes(data))
    inodes = {p: p.stat().st_ino for p in out.rglob("*") if p.is_file() and p.name != JOURNAL}

    rep = export_build(built, out, ExportOptions(format="specforge"))
    assert rep.complete and rep.repaired == [sid] and rep.exported == 1 and rep.already == 29, rep
    assert [p for p, ino in inodes.items() if p.stat().st_ino != ino] == [out / path]  # the one file rewritten
    files = json.loads((out / JOURNAL).read_text())["files"]
    assert files[sid][2] == file_digest(out / path) and files[sid][2].startswith("crc32c:")
    assert all(len(en[2]) == 32 for k, en in files.items() if k != sid)  # (the kept entries as they were)


# -- a power cut in the middle ------------------------------------------------------------------------------------

# the CLI, with the journal saved at every file taken back from the writers (not every few seconds): many saves,
# each vouching for the files written so far, in a small export
OFTEN = ("import sys; from builder.exchange import export_reconcile as r\n"
         "save = r.Reconcile.save\n"
         "def often(self, *a, **k):\n    save(self, *a, **k)\n    self.next_save = 0.0\n"
         "r.Reconcile.save = often\n"
         "from builder.cli.app import main; sys.exit(main(sys.argv[1:]))")


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != JOURNAL}


def test_power_cut_mid_export_leaves_every_vouched_file_whole(built, powercut):
    """lazyfs --dirs strict, power cut after a chosen number of writes in the middle of an export whose journal is
    saved often: every file the journal vouches for is there, whole (size and checksum); the same command then
    finishes the export, repairing nothing, and OUT holds the bytes of an export that was never cut."""
    fs = powercut("strict")
    args = ["export", built, "OUT0", "--format", "specforge", "--no-progress", "--json"]
    ops0 = fs.status()["mutating_ops"]
    r = fs.run(args, program=[sys.executable, "-c", OFTEN])
    assert r.returncode == 0, r.stderr
    total = fs.status()["mutating_ops"] - ops0
    want = _files(fs.path("OUT0"))
    assert len([k for k in want if "data_" in k]) == 30
    for i, frac in enumerate((0.4, 0.75)):
        out = f"OUT{i + 1}"
        fs.arm(int(total * frac))
        fs.popen([*args[:2], out, *args[3:]], program=[sys.executable, "-c", OFTEN])
        fs.wait_crash()
        fs.remount()
        journal = fs.path(out, JOURNAL)
        vouched = json.loads(journal.read_text())["files"] if journal.exists() else {}
        for sid, (path, _fp, digest, size, *at) in vouched.items():
            here = [fs.path(out, p) for p in (at[0] if at else [path])]
            assert any(p.is_file() and p.stat().st_size == size and file_digest(p) == digest for p in here), \
                f"cut at {frac:.0%}: the journal vouches for {sid} at {path}, not whole after the power cut"
        assert i == 0 or vouched, "the second cut came after the journal's first save with files"
        r = fs.run(args[:2] + [out] + args[3:])
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["complete"] and not rep["repaired"] and rep["already"] == len(vouched), rep
        assert _files(fs.path(out)) == want, f"cut at {frac:.0%}: the finished export differs from an uncut one"


def test_files_under_is_rglob_and_is_file(tmp_path):
    """`files_under` (what the formats' scans walk OUT with) finds what `sorted(rglob)` + is_file found, in its
    order: nested and hidden names, a link to a file taken, a linked folder not entered, a broken link, a folder
    or a fifo by a matching name left out."""
    import os

    from builder.formats.base import files_under

    root = tmp_path / "out"
    for rel in ("data_1.ckpt", "rows_0-1000/data_10.ckpt", "rows_0-1000/data_9.ckpt", "rows_0-1000.x/data_2.ckpt",
                "a/b/c/.data_3.ckpt", "a/data_4.ckpt.gz", "a/other.pt", "a-b/data_5.ckpt", "zz/x.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "folder_data_6.ckpt").mkdir()
    os.mkfifo(root / "a" / "data_7.ckpt")
    (root / "link_data_8.ckpt").symlink_to(root / "a" / "other.pt")
    (root / "broken_data_9.ckpt").symlink_to(root / "nowhere")
    (root / "linked").symlink_to(root / "rows_0-1000", target_is_directory=True)
    for keep in (lambda n: "data_" in n, lambda n: n.endswith(".pt"), lambda n: True):
        want = sorted(p for p in root.rglob("*") if p.is_file() and keep(p.name))
        assert files_under(root, keep) == want
    assert len(files_under(root, lambda n: "data_" in n)) == 8


def test_a_big_sample_is_streamed_as_torch_saves_bytes_within_its_bound():
    """A dict of more than FAST_MAX_BYTES of tensors is handed over as a `Streamed`: what it writes is torch.save's
    bytes of a copy of every tensor, no more than the bound the watermarks counted (a long string value too); a
    smaller one is made in memory."""
    import io

    big = {"ids": torch.arange(2000), "states": torch.randn(600, 1024).bfloat16(), "conversation_id": "é" * 60000}
    st = torchfile.save_streamed(big)
    assert isinstance(st, Streamed)
    buf = io.BytesIO()
    st.write(buf)
    assert buf.getvalue() == torchfile.torch_save_bytes(_copies(big)) and len(buf.getvalue()) <= st.size
    small = _rec(5, 1, "x")
    assert torchfile.save_streamed(small) == torchfile.torch_save_bytes(_copies(small))


def test_batches_read_ahead_give_the_files_of_one_batch(built, tmp_path, monkeypatch):
    """Read 4 samples a batch (8 batches, READ_AHEAD of them read on threads while one is written), the export is
    the one read in a single batch: the same files, each sample's at its row's path, the same journal entries."""
    from builder.exchange import export_reconcile

    one, many = tmp_path / "one", tmp_path / "many"
    assert export_build(built, one, ExportOptions(format="specforge")).exported == 30
    monkeypatch.setattr(export_reconcile, "READ_BATCH", 4)
    assert export_build(built, many, ExportOptions(format="specforge")).exported == 30
    assert _files(one) == _files(many)
    assert json.loads((one / JOURNAL).read_text())["files"] == json.loads((many / JOURNAL).read_text())["files"]
