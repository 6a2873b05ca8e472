"""A source is read in batches of rows, its tokens spilled to unlinked temporary files past a size: the samples,
their order and every error message are exactly those of a whole-file pass (line numbers, duplicate ids seen in
an earlier batch, the first bad row winning), and nothing is left in TMPDIR."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from builder.errors import SourceError
from builder.extract.model import builtin_tokenizer
from builder.extract.source import load_source
from tests.conftest import mounted_tmpfs, random_rows

WHOLE = {"batch_rows": 1 << 30, "spill_bytes": 1 << 40}  # one batch, held in memory: the reference
SMALL = {"batch_rows": 7, "spill_bytes": 0}  # batches of 7 rows, tokens in temporary files from the first


def rows_mixed(n: int = 60) -> list[dict]:
    """Token rows with and without masks, text rows, ids of both kinds and missing, blank lines between."""
    rows = random_rows(n, seed=5, lo=1, hi=40)
    for i, r in enumerate(rows):
        if i % 5 == 1:
            r.pop("loss_mask")
        if i % 7 == 3:
            r.pop("input_ids")
            r.pop("loss_mask", None)
            r["text"] = f"row {i} says hello " * (1 + i % 4)
        if i % 11 == 4:
            r.pop("id")
        elif i % 3 == 0:
            r["id"] = 10_000 + i  # an integer id
    return rows


def write(path, rows: list[dict], blank_every: int = 9):
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 2:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def same(a, b) -> None:
    assert len(a) == len(b)
    assert a.registry_columns()["sample_id"].equals(b.registry_columns()["sample_id"])
    for x, y in zip(a, b, strict=True):
        assert (x.sample_id, x.row, x.fingerprint) == (y.sample_id, y.row, y.fingerprint)
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)


def error_of(path, **kw) -> str:
    with pytest.raises(SourceError) as e:
        load_source(path, builtin_tokenizer(1024), **kw)
    return str(e.value)


def test_batches_and_spilled_tokens_give_the_whole_file_s_samples(tmp_path, monkeypatch):
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    src = write(tmp_path / "s.jsonl", rows_mixed())
    whole = load_source(src, builtin_tokenizer(1024), **WHOLE)
    small = load_source(src, builtin_tokenizer(1024), **SMALL)
    assert isinstance(small.tokens, np.memmap) and not isinstance(whole.tokens, np.memmap)
    same(small, whole)
    assert list(spill.iterdir()) == []  # the spill files have no name: nothing to clean up, even after kill -9
    # a sample's arrays are writable (torch.from_numpy takes them without a warning), the file never changes
    s = small[3]
    s.input_ids[0] += 1
    assert load_source(src, builtin_tokenizer(1024), **SMALL)[3].input_ids[0] == whole[3].input_ids[0]

    table = pa.table({"id": [f"p{i}" for i in range(50)],
                      "input_ids": [list(range(1, 2 + i % 9)) for i in range(50)]})
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=8)
    same(load_source(tmp_path / "s.parquet", **SMALL), load_source(tmp_path / "s.parquet", **WHOLE))


@pytest.mark.parametrize("plant", ["dup_across", "dup_before_error", "error_before_dup", "bad_mask_late",
                                   "null_id_dup", "missing_tokens_late"])
def test_errors_are_the_whole_file_s(tmp_path, plant):
    rows = rows_mixed(45)
    for r in rows:  # string ids only, so the planted duplicates are the only ones
        r["id"] = str(r.get("id", ""))
        if r["id"] == "":
            r.pop("id")
    if plant == "dup_across":
        rows[30]["id"] = rows[2]["id"]
    elif plant == "dup_before_error":  # same batch: a duplicate of batch 0 first, then a bad mask
        rows[29]["id"] = rows[1]["id"]
        rows[33] = {"id": "m", "input_ids": [1, 2, 3], "loss_mask": [1, 0]}
    elif plant == "error_before_dup":
        rows[29] = {"id": "m", "input_ids": [1, 2, 3], "loss_mask": [1, 0]}
        rows[33]["id"] = rows[1]["id"]
    elif plant == "bad_mask_late":
        rows[40] = {"id": "m", "input_ids": [1, 2, 3], "loss_mask": [1, 2, 0]}
    elif plant == "null_id_dup":  # a row without an id is named by its row number, which an id may repeat
        rows[5].pop("id")
        rows[38]["id"] = "5"
    else:
        rows[37] = {"id": "x", "note": "no tokens"}
    src = write(tmp_path / "bad.jsonl", rows)
    want = error_of(src, **WHOLE)
    assert error_of(src, **SMALL) == want
    assert error_of(src, batch_rows=4, spill_bytes=1 << 40) == want


def test_a_full_tmpdir_keeps_the_tokens_in_memory(tmp_path, monkeypatch):
    """TMPDIR on a real 1 MB tmpfs: the spill runs out of room part way, and the source still loads, whole."""
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        rows = [{"id": f"r{i}", "input_ids": list(range(1, 1 + 300 + i % 50))} for i in range(1000)]  # ~1.6 MB
        src = write(tmp_path / "big.jsonl", rows, blank_every=0)
        got = load_source(src, batch_rows=100, spill_bytes=0)
        assert not isinstance(got.tokens, np.memmap)
        same(got, load_source(src, **WHOLE))
        assert list(small.iterdir()) == []


def test_samples_made_in_bulk_are_the_ones_indexing_gives(tmp_path):
    """`SourceSamples.at` (how a plan makes its samples to do) gives, position for position, what indexing gives:
    id, row, tokens, mask and fingerprint; positions outside the source are refused."""
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in random_rows(40, seed=5)))
    samples = load_source(path, builtin_tokenizer(1024))
    at = [7, 0, 39, 7, -1]
    got = samples.at(at)
    for pos, s in zip(at, got, strict=True):
        want = samples[pos]
        assert (s.sample_id, s.row, s.fingerprint) == (want.sample_id, want.row, want.fingerprint)
        assert np.array_equal(s.input_ids, want.input_ids) and np.array_equal(s.loss_mask, want.loss_mask)
    assert samples.at([]) == []
    with pytest.raises(IndexError):
        samples.at([40])
