"""Every subcommand refuses out-of-range values of its numeric and enum flags the same way: exit code 2, the
first line of stderr `hsbuild CMD: error: ...` naming the flag, no traceback, and nothing in an existing build
changes (init and demo create nothing).

The CLI's `main` runs in this process (the same code path as the `hsbuild` script, without paying a Python +
torch start-up per case); an uncaught exception fails the test with its traceback."""

from __future__ import annotations

import contextlib
import hashlib
import io
from pathlib import Path

import pytest
from conftest import ROOMY, random_rows, write_jsonl

from builder.cli.app import main
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def call(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def build(tmp_path) -> Path:
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(4))
    return init_build(tmp_path / "b", src, model=MODEL, watermarks=ROOMY).root


def _init(tmp_path: Path, b: Path) -> dict[str, list[list[str]]]:
    src = str(tmp_path / "src.jsonl")
    (tmp_path / "a-file").write_text("x")
    new = ["init", str(tmp_path / "new"), "--source", src, "--model", MODEL]
    force = ["init", str(b), "--source", src, "--model", MODEL, "--force"]  # must refuse before deleting
    bad = [["--codec", "zstd:99"], ["--codec", "zstd:-200000"], ["--codec", "blosc-lz4:99"],
           ["--codec", "blosc-zstd:-1"], ["--codec", "zstd:x"], ["--codec", "lz5"], ["--codec", "none:3"],
           ["--staging", "/nonexistent"], ["--staging", str(tmp_path / "a-file")], ["--max-attempts", "0"],
           ["--chunk-tokens", "0"], ["--chunk-tokens", str(1 << 30)], ["--max-tokens", "0"], ["--max-tokens", "-1"],
           ["--max-tokens", "999999"], ["--low", "2"], ["--high", "0"], ["--flood", "-0.5"],
           ["--low", "0.95", "--high", "0.9"], ["--min-free=-5G"], ["--dtype", "int8"], ["--device", "tpu"],
           ["--aux-layers", "x"], ["--aux-layers", "1,1"], ["--aux-layers", "1,2,99"],
           ["--model", "builtin:layers=0"], ["--model", "/nonexistent-model"], ["--backend", "sglang-next"],
           ["--inflight", "0"], ["--server", "http://127.0.0.1:1"], ["--backend", "vllm"],
           ["--backend", "vllm", "--server", "127.0.0.1:8000", "--staging", str(tmp_path)],
           ["--backend", "vllm", "--server", "http://127.0.0.1:8000"],
           ["--backend", "vllm", "--server", "http://127.0.0.1:8000", "--staging", str(tmp_path)],
           ["--final-state", "middle"]]
    return {"new": [new + f for f in bad], "force": [force + f for f in bad[:12]]}


RUN_BAD = [["--workers", "0"], ["--workers", "-1"], ["--workers", "x"], ["--limit", "-5"], ["--max-attempts", "0"],
           ["--low", "2"], ["--high", "1.5"], ["--flood", "0"], ["--low", "0.95", "--high", "0.9"],
           ["--min-free=-1G"], ["--device", "tpu"], ["--inflight", "0"], ["--launch"]]
VERIFY_BAD = [["--max-rate", "-1"], ["--max-rate", "0"], ["--max-rate", "fast"], ["--jobs", "0"], ["--jobs", "1000"],
              ["--subset", "5/3"], ["--subset", "0/3"], ["--subset", "x"], ["--fraction", "2"], ["--fraction", "0"],
              ["--fraction", "0.5", "--seed", "x"], ["--seed", "3"], ["--not-verified-since", "yesterday"],
              ["--segment", "seg-nope"], ["--continue"], ["--json", "--csv"]]


def cases(cmd: str, tmp_path: Path, b: Path) -> list[list[str]]:
    if cmd == "init":
        c = _init(tmp_path, b)
        return c["new"] + c["force"]
    if cmd in ("run", "resume"):
        return [[cmd, str(b), "--no-progress", *f] for f in RUN_BAD]
    if cmd == "status":
        return [["status", str(b), "--json", "--csv"], ["status", str(tmp_path / "nope")]]
    if cmd == "sql":
        return [["sql", str(b), "SELECT 1", "--json", "--csv"], ["sql", str(b), "DELETE FROM events"],
                ["sql", str(b), "SELEC nonsense"]]
    if cmd == "verify":
        return [["verify", str(b), "--no-progress", *f] for f in VERIFY_BAD]
    if cmd == "gc":
        return [["gc", str(b), "--json", "--csv"], ["gc", str(tmp_path / "nope")]]
    if cmd == "doctor":
        return [["doctor", str(b), *f] for f in (["--gpu-mem-threshold=-1G"], ["--gpu-mem-threshold", "lots"],
                                                 ["--device", "tpu"], ["--device", "cuda:x"])]
    if cmd == "demo":
        return [["demo", str(tmp_path / "demo"), *f] for f in (["--samples", "0"], ["--samples", "-3"],
                                                               ["--workers", "0"], ["--samples", "many"])]


    if cmd == "export":
        out = str(tmp_path / "out")
        return [["export", str(b), out, "--no-progress", *f] for f in (
            ["--format", "nope"], ["--format", "specforge", "--limit", "0"], ["--format", "specforge", "--subset", "5/3"],
            ["--format", "specforge", "--draft-vocab-size", "0"], ["--format", "specforge", "--draft-vocab-size",
                                                                   "99999999"],
            ["--format", "specforge", "--compress", "12"], ["--format", "modelopt", "--compress", "6"],
            ["--format", "specforge", "--high", "2"], ["--format", "specforge", "--low", "0.95", "--high", "0.9"],
            ["--format", "speculators"],  # a post_norm build: speculators needs --final-state pre_norm
            ["--format", "specforge", "--json", "--csv"])] + [
            ["export", str(b), str(b / "inside"), "--format", "specforge"],
            ["export", str(tmp_path / "nope"), out, "--format", "specforge"]]
    if cmd == "import":
        (tmp_path / "dump").mkdir(exist_ok=True)
        return [["import", str(b), str(tmp_path / "dump"), "--no-progress", *f] for f in (
            ["--format", "nope"], ["--format", "pt"], ["--format", "pt", "--workers", "0"],
            ["--format", "pt", "--launch"], ["--format", "pt", "--dump-final-state", "middle"],
            ["--format", "pt", "--low", "2"])] + [
            ["import", str(b), str(tmp_path / "nope"), "--format", "modelopt"]]
    if cmd == "serve-command":
        return [["serve-command", str(b)], ["serve-command", str(tmp_path / "nope")]]
    raise AssertionError(cmd)


@pytest.mark.parametrize("cmd", ["init", "run", "resume", "status", "sql", "verify", "gc", "doctor", "demo",
                                 "serve-command", "export", "import"])
def test_out_of_range_flags_exit_2_in_one_line_and_change_nothing(tmp_path, build, cmd):
    before = digest(build)
    problems = []
    for argv in cases(cmd, tmp_path, build):
        rc, err = call(argv)
        first = err.splitlines()[0] if err else ""
        if rc != 2 or not first.startswith(f"hsbuild {cmd}: error:") or "Traceback" in err:
            problems.append(f"{' '.join(argv[2:] if cmd != 'init' else argv[5:])}: rc {rc}: {err.strip()[:300]}")
        if digest(build) != before:
            problems.append(f"{' '.join(argv)}: changed the build")
            before = digest(build)
    assert not (tmp_path / "new").exists() and not (tmp_path / "demo").exists() and not (tmp_path / "out").exists()
    assert not problems, "\n".join(problems)
