"""The reader's index (builder/reader/index.py: columns, not a dict per sample) gives exactly the entries and items
the `samples` view gives, read the straightforward way (a list of dicts, as the reader held it before), for
every trainer format: through a build's life (failures, a skip, damage repaired by verify and resume, source
changes), for every form of checksums a `written` event can hold, from the file and from a live owner. A
snapshot kept in the cache is never used for another state of the log, not even one with the same number of
events and the same last seq. Real builds, real logs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_rows, write_jsonl

from builder.config import BuildConfig
from builder.errors import DamagedSampleError
from builder.formats import registry
from builder.formats.base import Sample
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.log.query import run_query
from builder.log.server import QueryServer
from builder.reader import HiddenStateDataset
from builder.reader import snapshot as snap
from builder.run.coordinator import RunOptions, run_build
from builder.run.source_changes import skip_samples
from builder.store.reader import SegmentReader

NAN = 7  # the builtin model's testing aid: a sample holding this token fails `nonfinite`
MODEL = f"builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128,nan_token={NAN}"
FORMATS = [None, "specforge", "speculators", "modelopt"]


def _rows(n: int) -> list[dict]:
    rows = random_rows(n, seed=11, lo=4, hi=40)
    for r in rows:
        r["input_ids"] = [t if t != NAN else NAN + 1 for t in r["input_ids"]]
    return rows


def reference(build, include_unverified: bool = True) -> list[dict]:
    """The live samples as the reader listed them before its index: one dict per row of the `samples` view."""
    states = "('written', 'verified')" if include_unverified else "('verified')"
    cols, rows = run_query(layout(build), "SELECT sample_id, row_idx, segment, token_start, num_tokens, checksums "
                                          f"FROM samples WHERE state IN {states} ORDER BY row_idx, sample_id")
    return [dict(zip(cols, r, strict=True)) for r in rows]


def reference_item(build, entries: list[dict], i: int, fmt: str | None) -> dict:
    """Item i read the straightforward way from entry i (what the reader did with its list of dicts)."""
    e = entries[i]
    try:
        t = SegmentReader(layout(build).data).read(e["segment"], e["token_start"], e["num_tokens"], e["checksums"])
    except DamagedSampleError as err:
        raise err.with_context(sample_id=e["sample_id"], build=str(build)) from err.__cause__
    if fmt is None:
        return {"sample_id": e["sample_id"], "input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].long(),
                "hidden_state": t["hidden_state"], "aux_hidden_state": t["aux_hidden_state"]}
    f = registry.make_format(fmt, flag="format", exports=True)
    info = BuildInfo.load(layout(build))
    s = Sample(e["sample_id"], int(e["row_idx"]), i, t["input_ids"].long(), t["loss_mask"].long(),
               t["aux_hidden_state"], info.final(t["hidden_state"], f.final_state))
    return f.item(s)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def outcome(f, *args):
    """What reading gives: the item, or the error's text and fields."""
    try:
        return f(*args)
    except DamagedSampleError as e:
        return ("damaged", str(e), e.reason, e.sample_id, e.segment, e.field)


def check(build, formats=FORMATS) -> list[dict]:
    """Every entry and every item of the dataset, for each format and both `include_unverified`, is the
    reference's. Returns the reference entries (with unverified ones)."""
    for unverified in (True, False):
        want = reference(build, unverified)
        for fmt in formats:
            ds = HiddenStateDataset(build, include_unverified=unverified, format=fmt)
            assert len(ds) == len(want)
            assert [ds.index[i] for i in range(len(ds))] == want == list(ds.index)
            assert ds.index[:] == want and ds.index[-1:] == want[-1:]
            assert ds.by_id() == {e["sample_id"]: i for i, e in enumerate(want)}
            assert ds.by_row() == {e["row_idx"]: i for i, e in enumerate(want)}
            for i in range(len(ds)):
                got, ref = outcome(ds.__getitem__, i), outcome(reference_item, build, want, i, fmt)
                assert same(got, ref), (fmt, i, want[i]["sample_id"])
    return reference(build)


def has_transfer() -> bool:
    """speculators' hs_connectors is installed (the `trainers` extra plus hs-connectors, as .ci/run installs it)."""
    try:
        import hs_connectors.transfer  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def check_transfer(build, entries: list[dict]) -> None:
    """speculators' transfer plugin finds each source row's sample (None where the build holds none); nothing
    where hs_connectors is not installed (the test that calls it says so at its end)."""
    if not has_transfer():
        return
    from builder.reader.speculators_transfer import HsbuildTransfer  # noqa: PLC0415 (needs hs_connectors)

    tr = HsbuildTransfer(build)
    f = registry.make_format("speculators", flag="format", exports=True)
    info = BuildInfo.load(layout(build))
    rows = {e["row_idx"]: i for i, e in enumerate(entries)}
    for row in range(max(rows) + 2):
        got = tr.get_cached(row)
        if row not in rows:
            assert got is None, row
            continue
        e = entries[rows[row]]
        t = SegmentReader(layout(build).data).read(e["segment"], e["token_start"], e["num_tokens"], e["checksums"])
        s = Sample(e["sample_id"], row, rows[row], t["input_ids"].long(), t["loss_mask"].long(),
                   t["aux_hidden_state"], info.final(t["hidden_state"], f.final_state))
        assert same(got, {"hidden_states": f.stacked(s), "token_ids": s.input_ids}), row


def test_the_index_gives_the_views_items_through_a_builds_life(make_build, cli):
    rows = _rows(8)
    rows[4]["input_ids"][1] = NAN  # fails every run
    build = make_build(rows=rows, model=MODEL)
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 7
    first = check(build)
    assert "s0004" not in [e["sample_id"] for e in first]

    assert skip_samples(build, ["s0002"], note="too long for the trainer")
    skipped = check(build)
    assert "s0002" not in [e["sample_id"] for e in skipped]
    check_transfer(build, skipped)

    # damage repaired: verify finds it, resume extracts those samples again, elsewhere
    seg = layout(build).data / first[0]["segment"]
    victim = next(p for p in (seg / "hidden_state").rglob("*") if p.is_file() and p.name != "zarr.json")
    victim.unlink()
    assert cli("verify", build).returncode == 1
    assert first[0]["sample_id"] not in [e["sample_id"] for e in check(build)]  # found damaged: not served
    assert cli("resume", build, "--no-progress").returncode == 1  # (s0004 still fails)
    repaired = check(build)
    assert repaired[0]["segment"] != first[0]["segment"]
    assert cli("verify", build).returncode == 0
    check(build)

    # the source edited: row 1 changed, row 5 removed, a row added, s0004 fixed
    fixed = [dict(r) for r in rows]
    fixed[1] = {**rows[1], "input_ids": rows[1]["input_ids"][:-2], "loss_mask": rows[1]["loss_mask"][:-2]}
    fixed[4] = {**rows[4], "input_ids": [3 if t == NAN else t for t in rows[4]["input_ids"]]}
    new = {**_rows(9)[8], "id": "s0100"}
    fixed = [new] + fixed[:5] + fixed[6:]
    write_jsonl(Path(BuildConfig.from_toml(layout(build).config).source), fixed)
    assert cli("resume", build, "--no-progress", "--accept-source-changes").returncode == 0
    after = check(build)
    assert [e["sample_id"] for e in after] == [r["id"] for r in fixed if r["id"] != "s0002"]
    check_transfer(build, after)
    if not has_transfer():  # (everything above ran; only speculators' transfer plugin was not checked)
        pytest.skip("speculators' transfer plugin not checked: hs_connectors is not installed (pip install -e "
                    "'.[trainers]' and hs-connectors --no-deps, as .ci/run does)")


def _append(build, events: list[Event]) -> None:
    with EventLog(layout(build).events) as log:
        log.append(events)


def test_every_form_of_checksums_reads_as_before_from_the_file_and_from_a_live_owner(make_build, monkeypatch):
    build = make_build(rows=_rows(6), model=MODEL)
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    by_id = {e["sample_id"]: e for e in reference(build)}

    def again(sid: str, checksums: str | None) -> Event:  # the sample's `written` event, its checksums as given
        e = by_id[sid]
        return Event("written", run_id="test", sample_id=sid, attempt=1, segment=e["segment"],
                     token_start=e["token_start"], num_tokens=e["num_tokens"], nbytes=1, checksums=checksums)

    own = json.loads(by_id["s0000"]["checksums"])
    _append(build, [
        again("s0000", json.dumps(dict(reversed(own.items())))),  # not hsbuild's key order: kept as text
        again("s0001", json.dumps({k: v.upper() for k, v in json.loads(by_id["s0001"]["checksums"]).items()},
                                  sort_keys=True)),  # another case: the text compared as before (a mismatch)
        again("s0002", None),  # no checksums: presence only
        again("s0003", by_id["s0003"]["checksums"].replace("crc32c:", "crc32c:0", 1)),  # a digit more
        again("s0004", by_id["s0005"]["checksums"]),  # another sample's: a mismatch
    ])
    want = check(build)
    ds = HiddenStateDataset(build)
    assert [int(k) for k in ds.index.checks] == [2, 2, 0, 2, 1, 1]
    assert ds[0]["input_ids"].tolist() and ds[2]["input_ids"].tolist()
    for i in (1, 3, 4):
        with pytest.raises(DamagedSampleError, match="checksum mismatch"):
            ds[i]

    # the same index asked of a live owner (which holds the log file: nothing else can open it)
    made = []  # where each snapshot was read

    def read_columns(*a, f=snap.read_columns, **k):
        where, tables = f(*a, **k)
        made.append(where)
        return where, tables

    monkeypatch.setattr(snap, "read_columns", read_columns)
    lay = layout(build)
    log = EventLog(lay.events)
    server = QueryServer(lay.root / "hsbuild.sock", log, lambda: {"running": True, **log.progress()}).start()
    try:
        monkeypatch.setenv("HSBUILD_CACHE_DIR", str(lay.root.parent / "another-cache"))
        assert check(build) == want
        live = HiddenStateDataset(build)
    finally:
        server.stop()
        log.close()
    assert made and set(made) == {"owner"}, "the index was not asked of the owner"
    assert live.index.key == ds.index.key and [live.index[i] for i in range(6)] == want
    assert HiddenStateDataset(build).index.path == live.index.path  # the same state of the log: the same file


def test_an_index_made_for_another_state_of_the_log_is_never_used(make_build, tmp_path):
    build = make_build(rows=_rows(6), model=MODEL)
    run_build(build, RunOptions(workers=1, limit=3), echo=lambda m: None)
    ds = HiddenStateDataset(build)
    assert len(ds) == 3 and ds.index.path is not None and ds.index.path.exists()
    run_build(build, RunOptions(workers=1), echo=lambda m: None)  # resumed after the index was made
    assert [e["sample_id"] for e in HiddenStateDataset(build).index] == [f"s{i:04d}" for i in range(6)]
    check(build, formats=[None])

    # a log rolled back (its file's bytes put back, same inode) and grown again by as many events: the same count
    # and the same last seq, another state
    events = layout(build).events
    wal = events.with_name(events.name + ".wal")
    assert not wal.exists()  # (the log closed: its file holds it all)
    saved = tmp_path / "saved.duckdb"
    shutil.copyfile(events, saved)
    inode = events.stat().st_ino
    _append(build, [Event("retired", run_id="one", sample_id="s0001", reason="skipped")])
    before = run_query(layout(build), snap.KEY_SQL)[1][0]
    assert [e["sample_id"] for e in HiddenStateDataset(build).index] == ["s0000", "s0002", "s0003", "s0004", "s0005"]
    with open(events, "r+b") as f:
        f.truncate(0)
        f.write(saved.read_bytes())
    _append(build, [Event("retired", run_id="two", sample_id="s0004", reason="skipped")])
    assert not wal.exists()
    after = run_query(layout(build), snap.KEY_SQL)[1][0]
    assert events.stat().st_ino == inode and (after[0], after[1]) == (before[0], before[1])
    assert [e["sample_id"] for e in HiddenStateDataset(build).index] == ["s0000", "s0001", "s0002", "s0003", "s0005"]
    check(build, formats=[None])


def test_digits_are_read_as_numbers_only_when_all_are_lowercase_hex():
    """Every byte value in every place of the 8 digits: only 0-9 and a-f make a number (and the right one);
    anything else leaves the event's text as it is, compared as before."""
    import numpy as np  # noqa: PLC0415

    from builder.reader.columns import hex8  # noqa: PLC0415

    texts = [b"0123abcd", b"ffffffff", b"00000000", b"9a8b7c6d"]
    texts += [b"0" * k + bytes([v]) + b"0" * (7 - k) for k in range(8) for v in range(256)]
    ok, values = hex8(np.frombuffer(b"".join(texts), dtype="<u8"))
    for t, good, value in zip(texts, ok.tolist(), values.tolist(), strict=True):
        is_hex = all(c in b"0123456789abcdef" for c in t)
        assert good == is_hex, t
        if is_hex:
            assert value == int(t, 16), t


def test_a_damaged_index_file_is_made_again(make_build):
    build = make_build(rows=_rows(4), model=MODEL)
    run_build(build, RunOptions(workers=1), echo=lambda m: None)
    want = reference(build)
    path = HiddenStateDataset(build).index.path
    for offset in (-5, 30):  # a column's byte (the CRC-32C of the columns), the header's
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        ds = HiddenStateDataset(build)
        assert list(ds.index) == want and ds.index.path == path
        assert path.read_bytes() != bytes(data)  # written again
