"""Sources: JSONL and Parquet through DuckDB; every source-level problem is a one-line error naming the file,
line and field, exit 2, and nothing in an existing build changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import numpy as np
import pytest
from conftest import random_rows, write_jsonl

from builder.errors import SourceError
from builder.extract.model import builtin_tokenizer
from builder.extract.source import Sample, fingerprint, load_source
from builder.layout import layout
from builder.log.events import EventLog


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


# -- issue 11: json's own column, rows that tokenize to nothing, the same checks at run ---------------------


@pytest.mark.parametrize("bad", ['{"input_ids": [1, 2', '{"input_ids": [1, 2,, 3]}', '{"input_ids": [1], "text": "ab}',
                                 '{"input_ids": [1, 2]} x', '   {"input_ids": [1, 2]'],
                         ids=["truncated", "double-comma", "unterminated-string", "trailing-data", "indented"])
@pytest.mark.parametrize("eol", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_malformed_json_names_jsons_own_line_and_column(tmp_path, bad, eol):
    """The column is where json stopped on that line (a truncated line used to say column 1: the newline)."""
    try:
        json.loads(bad)
    except json.JSONDecodeError as e:
        want = e
    path = tmp_path / "s.jsonl"
    path.write_bytes(eol.join(['{"input_ids": [1, 2]}', bad, '{"input_ids": [3]}', ""]).encode())
    with pytest.raises(SourceError) as ei:
        load_source(path, builtin_tokenizer(1024))
    msg = str(ei.value)
    assert ei.value.line == 2 and want.lineno == 1 and want.colno > 1
    assert msg == f"{path}:2: malformed JSON: {want.msg.removesuffix(' at')} at column {want.colno}", msg
    assert " at at " not in msg and "\n" not in msg


class NothingChat:
    """A tokenizer with a chat template that tokenizes a conversation to nothing (a template that renders
    an empty string): the conversation counterpart of an empty text."""

    def encode(self, text: str) -> list[int]:
        return []

    def chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        return [], []


@pytest.mark.parametrize(("row", "tokenizer", "field", "message"), [
    ({"text": "hello"}, lambda text: [], "text", "has no tokens"),
    ({"text": "hello"}, lambda text: [5, 60], "text", "token id 60 is outside the model's vocabulary 0..49"),
    ({"text": "hello"}, lambda text: [-2], "text", "token id -2 is outside"),
    ({"messages": [{"role": "user", "content": "hi"}]}, NothingChat(), "messages", "has no tokens"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, NothingChat(), "conversations", "has no tokens"),
], ids=["text-empty", "text-over-vocab", "text-negative", "messages-empty", "sharegpt-empty"])
def test_rows_that_tokenize_to_nothing_or_outside_the_vocabulary_name_their_field(tmp_path, row, tokenizer, field,
                                                                                   message):
    src = write_jsonl(tmp_path / "s.jsonl", [{"input_ids": [5, 6]}, row])
    with pytest.raises(SourceError) as ei:
        load_source(src, tokenizer, vocab_size=50)
    assert ei.value.line == 2 and ei.value.field == field and message in str(ei.value)
    # without a vocabulary (a build's rebuild-log reading its source) the rows load as they did
    assert len(load_source(src, tokenizer)) == 2


def test_run_refuses_new_rows_the_model_cannot_take_in_one_line(tmp_path, make_build, cli):
    """Rows appended to an existing build's source: the run checks them as init does (exit 2, file, line and
    field) before anything is written, instead of failing them in every later run."""
    build = make_build(3)
    cli("run", build, "--no-progress", check=True)
    src = tmp_path / "build-source.jsonl"
    good = src.read_text()
    for row, message in (({"input_ids": [5, 2000]}, "token id 2000 is outside the model's vocabulary 0..1023"),
                         ({"input_ids": []}, "has no tokens"), ({"id": "neg", "input_ids": [-1]}, "token id -1")):
        src.write_text(good + json.dumps({"id": "ok", "input_ids": [5, 6, 7]}) + "\n" + json.dumps(row) + "\n")
        before = _tree_digest(build)
        for cmd in ("run", "resume"):
            cp = cli(cmd, build, "--no-progress")
            err = cp.stderr.strip()
            assert cp.returncode == 2, cp.stdout + cp.stderr
            assert err == f"hsbuild {cmd}: error: {src}:5: field 'input_ids': {err.split(': ', 4)[-1]}", err
            assert message in err and "Traceback" not in err
            assert _tree_digest(build) == before
    src.write_text(good)
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr


def test_a_build_that_registered_unusable_samples_still_runs(tmp_path, make_build, cli):
    """A build made before init refused such samples holds them registered: its runs go on as they did (the
    samples recorded `failed`, the others written), never refused for rows the build already took."""
    build = make_build(3)
    src = tmp_path / "build-source.jsonl"
    legacy = [{"id": "oov", "input_ids": [7, 5000]}, {"id": "empty", "input_ids": []}]
    with src.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in legacy)
    with EventLog(layout(build).events) as log:  # what init registered before it checked
        log.register_samples([Sample(r["id"], 3 + i, np.array(r["input_ids"], np.int32),
                                     np.ones(len(r["input_ids"]), np.uint8),
                                     fingerprint(np.array(r["input_ids"], np.int32),
                                                 np.ones(len(r["input_ids"]), np.uint8)))
                              for i, r in enumerate(legacy)])
    for _ in range(2):
        cp = cli("run", build, "--no-progress")
        assert cp.returncode == 1 and "Traceback" not in cp.stderr, cp.stdout + cp.stderr
    cp = cli("sql", build, "SELECT sample_id, state, error FROM samples ORDER BY sample_id", "--json")
    states = {r["sample_id"]: (r["state"], r["error"]) for r in json.loads(cp.stdout)}
    assert states["oov"] == ("failed", "token_out_of_range") and states["empty"] == ("failed", "empty_sample")
    assert sum(s == ("written", None) for s in states.values()) == 3


def test_malformed_state_json_of_a_dataset_dir_names_its_line_and_column(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "state.json").write_text('{\n  "_data_files": [\n    {"filename": "data-00000-of-00001.arrow"\n  ]\n}\n')
    with pytest.raises(SourceError) as ei:
        load_source(d)
    assert ei.value.path == str(d / "state.json") and ei.value.line == 4
    assert str(ei.value) == f"{d / 'state.json'}:4: malformed JSON: Expecting ',' delimiter at column 3"
