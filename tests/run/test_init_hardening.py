"""What `init` accepts, what `init --force` replaces, and a build's format: it never holds two (no flag mixes
them), and a build on a read-only volume refuses to be written with one line, not a traceback."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import mounted_tmpfs, random_rows, write_jsonl

from builder.errors import SampleError
from builder.extract.model import Extractor
from builder.humanize import human_bytes

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "hsbuild.lock"}


def one_line_error(cp: subprocess.CompletedProcess, cmd: str) -> str:
    err = cp.stderr.strip()
    assert err.startswith(f"hsbuild {cmd}: error:") and "\n" not in err and "Traceback" not in err, cp.stderr
    return err


def sql(cli, build, query: str) -> list[dict]:
    cp = cli("sql", build, query, "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


# -- init --force ------------------------------------------------------------------------------------------


def test_force_on_a_build_without_its_config_starts_a_coherent_empty_build(tmp_path, make_build, cli):
    build = make_build(4)
    cli("run", build, "--no-progress", check=True)
    (build / "hsbuild.toml").unlink()  # a half-deleted build: the old log and data are still there
    cp = cli("init", build, "--source", tmp_path / "build-source.jsonl", "--model", MODEL, "--force",
             "--high", "0.998", "--low", "0.997", "--flood", "0.999")
    assert cp.returncode == 0, cp.stderr
    assert sql(cli, build, "SELECT count(*) AS n FROM events WHERE kind <> 'init'") == [{"n": 0}]
    assert sql(cli, build, "SELECT DISTINCT state FROM samples") == [{"state": "pending"}]
    assert [p.name for p in (build / "data").iterdir()] == ["zarr.json"]
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 0 and "wrote 4" in cp.stdout, cp.stdout + cp.stderr
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 0 and "ok 4" in cp.stdout, cp.stdout + cp.stderr


def test_force_refuses_to_delete_what_is_not_hsbuilds(tmp_path, cli):
    d = tmp_path / "mine"
    (d / "data").mkdir(parents=True)
    (d / "data" / "precious.txt").write_text("not hsbuild's")
    (d / "events.duckdb").write_text("not a database")
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(2))
    before = tree_digest(d)
    cp = cli("init", d, "--source", src, "--model", MODEL, "--force")
    assert cp.returncode == 2
    assert "not an hsbuild" in one_line_error(cp, "init")
    assert tree_digest(d) == before


# -- the format: aux layers, max tokens, changed config ------------------------------------------------------


@pytest.mark.parametrize(("layers", "want"), [(4, [1, 2, 3]), (6, [1, 3, 5]), (7, [2, 3, 4]), (32, [2, 16, 29])])
def test_default_aux_layers_are_distinct(layers, want):
    ex = Extractor(f"builtin:hidden=16,layers={layers},vocab=64,heads=2,kv_heads=1,intermediate=16", device="cpu")
    assert ex.aux_layers == want


@pytest.mark.parametrize(("flags", "message"), [
    (["--aux-layers", "2,2,3"], "appears more than once"),
    (["--aux-layers", "1,2,9"], "outside 0..4"),
    (["--model", "builtin:hidden=16,layers=3,vocab=1024,heads=2,kv_heads=1,intermediate=16"], "--aux-layers"),
    (["--model", MODEL + ",max_positions=256", "--max-tokens", "300"], "--max-tokens 300: more than the model's 256"),
], ids=["duplicate", "out-of-range", "too-few-layers", "max-tokens-over-positions"])
def test_init_refuses_a_format_the_model_cannot_have(tmp_path, cli, flags, message):
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(2))
    args = ["init", tmp_path / "b", "--source", src] + (["--model", MODEL] if "--model" not in flags else [])
    cp = cli(*args, *flags)
    assert cp.returncode == 2
    assert message in one_line_error(cp, "init")
    assert not (tmp_path / "b").exists()


def test_per_sample_limit_is_the_smaller_of_max_tokens_and_positions():
    """A build whose max_tokens exceeds the model's positions (made before init checked it) still fails
    over-long samples `too_long` instead of running them past the model's positions."""
    ex = Extractor(MODEL + ",max_positions=32", device="cpu")
    ids = np.arange(3, 53, dtype=np.int32)  # 50 tokens
    for max_tokens in (40, 1000):  # truncated to 40 is still longer than 32 positions
        with pytest.raises(SampleError) as ei:
            ex.check(ids, max_tokens=max_tokens)
        assert ei.value.reason == "too_long"
    assert ex.check(ids, max_tokens=20).shape[0] == 20


def test_rows_longer_than_a_run_keeps_are_handled_as_init_said(tmp_path, cli):
    """Issue 41: `init` said every row longer than --max-tokens would be cut, yet a build made without it failed
    rows longer than the model's positions. Now each says what the run does: with --max-tokens they are cut to
    it (and marked `truncated`), written, and `status` agrees; without it `init` names how many will fail
    (`too_long`) and the longest, and the run fails exactly those."""
    model = MODEL + ",max_positions=64"
    lengths = {"r0": 10, "r1": 40, "r2": 100, "r3": 200}
    src = write_jsonl(tmp_path / "s.jsonl", [{"id": k, "input_ids": [5 + i % 900 for i in range(n)]}
                                             for k, n in lengths.items()])
    wm = ("--high", "0.998", "--low", "0.997", "--flood", "0.999")

    cut = tmp_path / "cut"
    cp = cli("init", cut, "--source", src, "--model", model, "--max-tokens", "50", *wm)
    assert cp.returncode == 0, cp.stderr
    assert ("source: 4 sample(s), 150 token(s) as stored: 2 longer than --max-tokens 50 (the longest: r3, 200 "
            "tokens) are cut to it") in cp.stdout, cp.stdout
    cp = cli("run", cut, "--no-progress")
    assert cp.returncode == 0 and "wrote 4, failed 0" in cp.stdout, cp.stdout + cp.stderr
    got = sql(cli, cut, "SELECT sample_id, state, num_tokens FROM samples ORDER BY sample_id")
    assert [(r["sample_id"], r["state"], r["num_tokens"]) for r in got] == [
        ("r0", "written", 10), ("r1", "written", 40), ("r2", "written", 50), ("r3", "written", 50)]
    truncated = sql(cli, cut, "SELECT sample_id, json_extract(detail, '$.truncated')::INT AS t FROM events "
                              "WHERE kind = 'written' ORDER BY sample_id")
    assert [r["t"] for r in truncated] == [0, 0, 50, 150]
    st = json.loads(cli("status", cut, "--json", check=True).stdout)
    assert (st["done"], st["failed"], st["tokens_done"], st["tokens_total"]) == (4, 0, 150, 150), st

    uncut = tmp_path / "uncut"
    cp = cli("init", uncut, "--source", src, "--model", model, *wm)
    assert cp.returncode == 0, cp.stderr
    assert "cut to" not in cp.stdout.replace("to keep them cut to 64 tokens", ""), cp.stdout
    assert ("too long: 2 sample(s) longer than the model's 64 positions (the longest: r3, 200 tokens) will fail "
            "(`too_long`)") in cp.stdout, cp.stdout
    assert "--max-tokens 64" in cp.stdout and f"hsbuild skip {uncut}" in cp.stdout, cp.stdout
    cp = cli("run", uncut, "--no-progress")
    assert cp.returncode == 1 and "wrote 2, failed 2" in cp.stdout, cp.stdout + cp.stderr
    failed = sql(cli, uncut, "SELECT sample_id, error FROM samples WHERE state = 'failed' ORDER BY sample_id")
    assert failed == [{"sample_id": "r2", "error": "too_long"}, {"sample_id": "r3", "error": "too_long"}]
    st = json.loads(cli("status", uncut, "--json", check=True).stdout)
    assert st["failed_by_reason"] == {"too_long": 2}, st


def _edit_config(build: Path, key: str, value: str) -> None:
    cfg = build / "hsbuild.toml"
    lines = [ln for ln in cfg.read_text().splitlines() if not ln.startswith(f"{key} =")]
    i = lines.index("") if "" in lines else len(lines)  # before [watermarks]
    cfg.write_text("\n".join(lines[:i] + [f"{key} = {value}"] + lines[i:]) + "\n")


@pytest.mark.parametrize(("key", "value"), [("aux_layers", "[1, 2]"), ("max_tokens", "16"),
                                            ("codec", '"blosc-lz4:5"')])
def test_a_changed_format_is_refused_even_with_force(tmp_path, make_build, cli, key, value):
    build = make_build(6)
    cli("run", build, "--no-progress", "--limit", "3", check=True)
    _edit_config(build, key, value)
    before = tree_digest(build)
    cp = cli("resume", build, "--no-progress", "--force")
    assert cp.returncode == 2
    err = one_line_error(cp, "resume")
    assert f"({key} " in err and "restore hsbuild.toml" in err and "hsbuild init NEWDIR" in err
    assert "--force does not override" in err
    assert tree_digest(build) == before
    # doctor agrees: a FAIL naming the key, which --force does not override
    cp = cli("doctor", build, "--json", "--no-probe", "--no-record")
    assert cp.returncode == 4
    fp = next(c for c in json.loads(cp.stdout)["checks"] if c["name"] == "build.fingerprint")
    assert fp["status"] == "fail" and fp["data"]["changed_keys"] == [key] and fp["data"]["overridable"] is False
    cp = cli("doctor", build, "--no-probe", "--no-record")
    assert "--force does not override build.fingerprint" in cp.stdout


def test_force_overrides_other_preflight_problems_only(tmp_path, make_build, cli):
    staging = tmp_path / "staging"
    staging.mkdir()
    build = make_build(4, staging=str(staging))
    staging.rmdir()  # a blocking preflight problem (storage.staging FAIL) that --force may override
    cp = cli("run", build, "--no-progress", "--limit", "1")
    assert cp.returncode == 4 and "storage.staging" in cp.stderr, cp.stderr
    _edit_config(build, "aux_layers", "[1, 2]")
    cp = cli("run", build, "--no-progress", "--force")
    assert cp.returncode == 2 and "aux_layers" in one_line_error(cp, "run")
    _edit_config(build, "aux_layers", "[1, 2, 3]")  # restored: now --force covers the staging problem alone
    cp = cli("run", build, "--no-progress", "--force")
    assert cp.returncode == 0 and "wrote 4" in cp.stdout, cp.stdout + cp.stderr


# -- read-only builds ----------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "64m") as mnt:
        yield mnt


def test_read_only_build_is_refused_in_one_line(tmp_path, small_tmpfs, cli):
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(3))
    build = small_tmpfs / "b"
    wm = ["--high", "0.998", "--low", "0.997", "--flood", "0.999"]
    cli("init", build, "--source", src, "--model", MODEL, *wm, check=True)
    cli("run", build, "--no-progress", check=True)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    before = tree_digest(build)
    for args in (["verify", build, "--no-progress"], ["gc", build], ["resume", build, "--no-progress"],
                 ["init", build, "--source", src, "--model", MODEL, "--force", *wm]):
        cp = cli(*args)
        assert cp.returncode == 2, (args, cp.stderr)
        assert "not writable" in one_line_error(cp, args[0])
    assert tree_digest(build) == before
    # reading still works
    assert sql(cli, build, "SELECT count(*) AS n FROM samples WHERE state = 'written'") == [{"n": 3}]


# -- issue 11: capacity under --max-tokens, a staging folder that moves or vanishes ----------------------------

WM = ["--high", "0.998", "--low", "0.997", "--flood", "0.999"]


def test_init_status_and_run_project_the_same_size_when_max_tokens_cuts_samples(tmp_path, cli):
    """Samples longer than --max-tokens are stored cut: init's projection, status's and the run's preflight
    all count min(tokens, max_tokens) (the run used to count the whole samples: 4x here), and init sizes the
    chunks for the cut samples."""
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(12, lo=300, hi=400))
    build = tmp_path / "b"
    cp = cli("init", build, "--source", src, "--model", MODEL, "--max-tokens", "32", *WM)
    assert cp.returncode == 0, cp.stderr
    init_size = re.search(r"^projected size: (\S+ \S+) \(estimate", cp.stdout, re.M).group(1)
    assert "chunk_tokens = 32\n" in (build / "hsbuild.toml").read_text()
    st = json.loads(cli("status", build, "--json", check=True).stdout)
    assert st["remaining_tokens"] == 12 * 32
    assert human_bytes(st["projected_bytes"]) == init_size
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    run_size = re.search(r"^capacity: (\S+ \S+) more projected \(estimate", cp.stderr, re.M).group(1)
    assert run_size == init_size, (init_size, run_size)
    assert sql(cli, build, "SELECT sum(num_tokens) AS n FROM samples") == [{"n": 12 * 32}]


def test_staging_is_kept_absolute_and_a_vanished_one_never_crashes(tmp_path, cli):
    """`--staging stg` is recorded as the folder it names, so runs from another directory find it; once it is
    gone, status works, run refuses with its preflight problem (exit 4) or runs with --force, never a traceback."""
    (tmp_path / "stg").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(3))
    cp = cli("init", "b", "--source", src, "--model", MODEL, "--staging", "stg", *WM, cwd=tmp_path)
    assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr
    build = tmp_path / "b"
    assert f'staging = "{tmp_path / "stg"}"' in (build / "hsbuild.toml").read_text()
    cp = cli("run", build, "--no-progress", "--limit", "1", cwd=elsewhere)
    assert cp.returncode == 0, cp.stderr
    (tmp_path / "stg").rmdir()
    for args, rc in ((["status", build], 0), (["status", build, "--json"], 0), (["doctor", build, "--no-record"], 4),
                     (["run", build, "--no-progress"], 4)):
        cp = cli(*args, cwd=elsewhere)
        assert cp.returncode == rc and "Traceback" not in cp.stdout + cp.stderr, (args, cp.stdout + cp.stderr)
    assert "hsbuild run: error: 1 blocking preflight problem" in cp.stderr and "storage.staging" in cp.stderr
    cp = cli("run", build, "--no-progress", "--force", cwd=elsewhere)
    assert cp.returncode == 0 and "wrote 2" in cp.stdout, cp.stdout + cp.stderr
