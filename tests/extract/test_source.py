"""Sources: JSONL and Parquet through DuckDB; every source-level problem is a one-line error naming the file,
line and field, exit 2, and nothing in an existing build changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import pytest
from conftest import random_rows, write_jsonl

from builder.errors import SourceError
from builder.extract.model import builtin_tokenizer
from builder.extract.source import fingerprint, load_source


def test_jsonl_with_ids_masks_and_text(tmp_path):
    rows = [{"id": "x", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"id": 7, "text": "hé"}, {"input_ids": [9]}]
    samples = load_source(write_jsonl(tmp_path / "s.jsonl", rows), builtin_tokenizer(1024))
    assert [s.sample_id for s in samples] == ["x", "7", "2"]  # id, or the row number
    assert samples[0].loss_mask.tolist() == [0, 1, 1]
    assert samples[1].input_ids.tolist() == [1, ord("h") + 3, 0xC3 + 3, 0xA9 + 3]
    assert samples[2].loss_mask.tolist() == [1]  # default: every token trains
    assert samples[0].fingerprint == fingerprint(samples[0].input_ids, samples[0].loss_mask)
    assert samples[0].fingerprint != fingerprint(samples[0].input_ids, samples[0].loss_mask[::-1].copy())


def test_parquet_source(tmp_path):
    rows = random_rows(5)
    write_jsonl(tmp_path / "s.jsonl", rows)
    pq = tmp_path / "s.parquet"
    duckdb.sql(f"COPY (SELECT * FROM read_json('{tmp_path / 's.jsonl'}')) TO '{pq}' (FORMAT parquet)")
    a = load_source(pq)
    b = load_source(tmp_path / "s.jsonl")
    assert [(s.sample_id, s.fingerprint) for s in a] == [(s.sample_id, s.fingerprint) for s in b]


BAD = [
    ("missing.jsonl", None, "file not found", None, None),
    ("bad.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [1, 2\n', "malformed JSON", 2, None),
    ("nofield.jsonl", '{"input_ids": [1]}\n{"tokens": [1, 2]}\n', "missing", 2, "input_ids"),
    ("typed.jsonl", '{"input_ids": [1]}\n{"input_ids": [1]}\n{"input_ids": ["a", 2]}\n', "list of integers", 3,
     "input_ids"),
    ("mask.jsonl", '{"input_ids": [1, 2], "loss_mask": [1]}\n', "has 1 entries", 1, "loss_mask"),
    ("dup.jsonl", '{"id": "a", "input_ids": [1]}\n{"id": "a", "input_ids": [2]}\n', "duplicate id", 2, "id"),
    ("text.jsonl", '{"text": 5}\n', "must be a string", 1, "text"),
    ("null.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [1, null, 3]}\n', "holds null at position 1", 2,
     "input_ids"),
    ("maskull.jsonl", '{"input_ids": [1, 2], "loss_mask": [1, null]}\n', "holds null", 1, "loss_mask"),
    ("floatid.jsonl", '{"id": 1, "input_ids": [1]}\n{"id": 1.5, "input_ids": [2]}\n', "string or an integer", 2,
     "id"),
    ("objid.jsonl", '{"id": "a", "input_ids": [1]}\n{"id": {"x": 1}, "input_ids": [2]}\n', "string or an integer",
     2, "id"),
    ("objids.jsonl", '{"id": {"x": 2}, "input_ids": [1]}\n{"id": {"x": 1}, "input_ids": [2]}\n',
     "string or an integer", 1, "id"),
    ("mixedsign.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [-1, 18446744073709551615]}\n', "32-bit", 2,
     "input_ids"),
    ("notutf8.jsonl", b'{"input_ids": [1]}\n{"input_ids": [2], "text": "\xff\xfe"}\n', "not UTF-8", 2, "text"),
    ("empty.jsonl", "", "empty", None, None),
    ("x.csv", "a,b\n", "unknown source type", None, None),
]


@pytest.mark.parametrize(("name", "content", "message", "line", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_sources_name_file_line_and_field(tmp_path, name, content, message, line, field):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SourceError) as ei:
        load_source(path, builtin_tokenizer(1024))
    e = ei.value
    assert message in str(e)
    assert e.path == str(path) and e.line == line and e.field == field
    assert "\n" not in str(e)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "hsbuild.lock"}


def test_cli_bad_source_exit_2_and_nothing_changes(tmp_path, make_build, cli):
    # init with a malformed source: exit 2, one line naming file and line, no build created
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1]}\n{"input_ids": [1,\n')
    cp = cli("init", tmp_path / "new", "--source", bad)
    assert cp.returncode == 2
    assert cp.stderr.strip().count("\n") == 0 and f"{bad}:2" in cp.stderr and "malformed JSON" in cp.stderr
    assert not (tmp_path / "new").exists()

    # an existing, finished build whose source is later damaged: run refuses, nothing changes
    build = make_build(6)
    cli("run", build, "--no-progress", check=True)
    before = _tree_digest(build)
    src = tmp_path / "build-source.jsonl"
    lines = src.read_text().splitlines()
    lines[3] = lines[3].replace('"loss_mask": [', '"loss_mask": ["x", ')
    src.write_text("\n".join(lines) + "\n")
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 2, cp.stderr
    assert f"{src}:4" in cp.stderr and "loss_mask" in cp.stderr
    assert _tree_digest(build) == before

    # init over an existing build refuses without --force, and changes nothing
    cp = cli("init", build, "--source", tmp_path / "bad.jsonl")
    assert cp.returncode == 2 and "--force" in cp.stderr
    assert _tree_digest(build) == before


def test_source_changed_under_finished_sample_is_refused(tmp_path, make_build, cli):
    build = make_build(5)
    cli("run", build, "--no-progress", check=True)
    src = tmp_path / "build-source.jsonl"
    rows = [json.loads(x) for x in src.read_text().splitlines()]
    rows[2]["input_ids"][0] += 1
    write_jsonl(src, rows)
    before = _tree_digest(build)
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 2 and "changed" in cp.stderr and "s0002" in cp.stderr
    assert _tree_digest(build) == before


def test_parquet_null_inside_a_list_names_the_row(tmp_path):
    pq = tmp_path / "s.parquet"
    duckdb.sql(f"COPY (SELECT * FROM (VALUES ([1, 2]), ([3, NULL])) t(input_ids)) TO '{pq}' (FORMAT parquet)")
    with pytest.raises(SourceError) as ei:
        load_source(pq)
    assert "holds null" in str(ei.value) and "(row 2)" in str(ei.value) and ei.value.field == "input_ids"


@pytest.mark.parametrize(("rows", "line", "message"), [
    ([{"input_ids": [5, 6]}, {"input_ids": []}], 2, "has no tokens"),
    ([{"input_ids": [5, 6]}, {"input_ids": [5]}, {"input_ids": [7, 5000]}], 3, "token id 5000 is outside"),
    ([{"input_ids": [-3]}], 1, "token id -3 is outside"),
], ids=["empty", "over-vocab", "negative"])
def test_init_refuses_samples_the_model_cannot_take(tmp_path, cli, rows, line, message):
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    cp = cli("init", tmp_path / "b", "--source", src)
    assert cp.returncode == 2
    err = cp.stderr.strip()
    assert err.startswith("hsbuild init: error:") and "\n" not in err
    assert f"{src}:{line}: field 'input_ids': {message}" in err
    assert not (tmp_path / "b").exists()
