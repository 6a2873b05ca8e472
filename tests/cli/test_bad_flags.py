"""Every subcommand refuses out-of-range and malformed values of each of its value-taking flags the same way:
exit code 2, the first line of stderr `hsbuild CMD: error: ...` naming the flag, no traceback, and nothing in an
existing build changes (init, demo and export create nothing).

The CLI's `main` runs in this process (the same code path as the `hsbuild` script, without paying a Python +
torch start-up per case); an uncaught exception fails the test with its traceback. The cases a user reported
also run as real subprocesses. A coverage test lists the subcommands and their flags from the parser itself, so
a new command or flag without a bad-value case here fails."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
from pathlib import Path

import pytest
from conftest import ROOMY, random_rows, write_jsonl

from builder.cli.app import build_parser, main
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
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "hsbuild.lock"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> tuple[Path, Path]:
    """(a folder, a small build in it): made once for the module; no case may change it."""
    d = tmp_path_factory.mktemp("flags")
    src = write_jsonl(d / "src.jsonl", random_rows(4))
    (d / "a-file").write_text("x")
    (d / "dump").mkdir()
    # post_norm (not the default): exporting it for speculators is refused, naming --final-state
    return d, init_build(d / "b", src, model=MODEL, watermarks=ROOMY, final_state="post_norm").root


# A case: (argv after the command, what the first line must name). `None`: the first `--flag` of argv.
Case = tuple[list[str], str | None]

WATERMARKS = [(["--low", "2"], None), (["--high", "1.5"], None), (["--flood", "0"], None), (["--high", "x"], None),
              (["--low", "0.95", "--high", "0.9"], "--high")]
RUN = [(["--workers", "0"], None), (["--workers", "-1"], None), (["--workers", "x"], None),
       (["--limit", "-5"], None), (["--limit", "1.5"], None), (["--max-attempts", "0"], None),
       (["--min-free=-1G"], "--min-free"), (["--min-free", "lots"], None), (["--device", "tpu"], None),
       (["--device", "cuda:x"], None), (["--inflight", "0"], None), (["--launch"], None),
       (["--batch-tokens", "-1"], None), (["--batch-tokens", "many"], None),
       (["--ray", "nowhere"], None), (["--ray", "head:99999"], None),
       (["--metrics", "9400"], None), (["--metrics", "127.0.0.1:70000"], None),
       (["--source", "/nonexistent.jsonl"], None), *WATERMARKS]


def cases(cmd: str, d: Path, b: Path) -> list[Case]:
    src, nope = str(d / "src.jsonl"), str(d / "nope")
    missing_build = ([nope], nope)
    if cmd == "init":
        return [([str(d / "new"), "--source", src, "--model", MODEL, *f], name) for f, name in INIT] + [
            ([str(b), "--source", src, "--model", MODEL, "--force", *f], name)  # refused before deleting
            for f, name in INIT[:14]] + [
            ([str(d / "a-file"), "--source", src], str(d / "a-file"))]
    if cmd in ("run", "resume"):
        return [([str(b), "--no-progress", *f], name) for f, name in RUN] + [missing_build]
    if cmd == "status":
        return [([str(b), "--json", "--csv"], "--csv"), missing_build]
    if cmd == "sql":
        return [([str(b), "SELECT 1", *f], name) for f, name in (
            (["--json", "--csv"], "--csv"), (["--timeout", "-1"], None), (["--timeout", "0"], None),
            (["--timeout", "x"], None), (["--timeout", "nan"], None), (["--timeout", "1e400"], None))] + [
            ([str(b), "DELETE FROM events"], "DELETE"), ([str(b), "SELEC nonsense"], "SELEC"),
            ([nope, "SELECT 1"], nope)]
    if cmd == "verify":
        return [([str(b), "--no-progress", *f], name) for f, name in (
            (["--max-rate", "-1"], None), (["--max-rate", "0"], None), (["--max-rate", "fast"], None),
            (["--jobs", "0"], None), (["--jobs", "1000"], None), (["--jobs", "two"], None),
            (["--subset", "5/3"], None), (["--subset", "0/3"], None), (["--subset", "x"], None),
            (["--subset", "1/0"], None), (["--fraction", "2"], None), (["--fraction", "0"], None),
            (["--fraction", "half"], None), (["--fraction", "0.5", "--seed", "x"], "--seed"),
            (["--seed", "3"], None), (["--not-verified-since", "yesterday"], None), (["--segment", "seg-nope"], None),
            (["--continue"], None), (["--json", "--csv"], "--csv"))] + [missing_build]
    if cmd == "gc":
        return [([str(b), "--json", "--csv"], "--csv"), missing_build]
    if cmd == "doctor":
        return [([str(b), *f], None) for f in (["--gpu-mem-threshold=-1G"], ["--gpu-mem-threshold", "lots"],
                                               ["--device", "tpu"], ["--device", "cuda:x"])] + [missing_build]
    if cmd == "demo":
        return [([str(d / "demo"), *f], None) for f in (["--samples", "0"], ["--samples", "-3"],
                                                        ["--workers", "0"], ["--samples", "many"])]
    if cmd == "export":
        out = str(d / "out")
        return [([str(b), out, "--no-progress", *f], name) for f, name in (
            (["--format", "nope"], None), (["--format", "specforge", "--limit", "0"], "--limit"),
            (["--format", "specforge", "--subset", "5/3"], "--subset"),
            (["--format", "specforge", "--draft-vocab-size", "0"], "--draft-vocab-size"),
            (["--format", "specforge", "--draft-vocab-size", "99999999"], "--draft-vocab-size"),
            (["--format", "specforge", "--compress", "12"], "--compress"),
            (["--format", "modelopt", "--compress", "6"], "--compress"),
            (["--format", "specforge", "--high", "2"], "--high"),
            (["--format", "specforge", "--flood", "0"], "--flood"),
            (["--format", "specforge", "--low", "0.95", "--high", "0.9"], "--high"),
            (["--format", "speculators"], "--final-state"),  # a post_norm build: speculators needs pre_norm
            (["--format", "specforge", "--json", "--csv"], "--csv"))] + [
            ([str(b), str(b / "inside"), "--format", "specforge"], str(b / "inside")),
            ([nope, out, "--format", "specforge"], nope)]
    if cmd == "import":
        dump, layers = str(d / "dump"), ["--dump-layers", "0,1,2"]  # the build's aux layers, pt's numbering
        return [([str(b), dump, "--no-progress", "--format", "pt", *layers, *f], name) for f, name in RUN] + [
            ([str(b), dump, "--no-progress", *f], name) for f, name in (
                (["--format", "nope", *layers], "--format"), (["--format", "pt", *layers], dump),
                (["--format", "pt", *layers, "--dump-final-state", "middle"], "--dump-final-state"),
                (["--format", "pt"], "--dump-layers"),  # a dump that does not say which layers it holds
                (["--format", "pt", "--dump-layers", "x"], "--dump-layers"),
                (["--format", "pt", "--dump-layers", ""], "--dump-layers"),
                (["--format", "pt", "--dump-layers", "1,1,2"], "--dump-layers"),
                (["--format", "pt", "--dump-layers=-2,0,1"], "--dump-layers"),
                (["--format", "pt", *layers, "--dump-layer-convention", "mine"], "--dump-layer-convention"))] + [
            ([str(b), nope, "--format", "modelopt", *layers], nope), ([nope, dump, "--format", "pt", *layers], nope)]
    if cmd == "skip":
        return [([str(b), "s0000", "--reason", ""], "--reason"), ([str(b), "--reason", "x"], "ID"),
                ([nope, "s0000", "--reason", "x"], nope)]
    if cmd == "report":  # (without matplotlib it names the extra first: exit 2 all the same)
        out = "-o" if importlib.util.find_spec("matplotlib") is not None else "hsbuild[report]"
        return [([str(b), "--output", str(d / "nodir" / "r.html")], out), ([str(b), "--output", str(d)], "-o"),
                ([str(b), "--json", "--output"], "--output"), missing_build]
    if cmd in ("serve-command", "rebuild-log"):
        return ([([str(b)], "inprocess")] * (cmd == "serve-command") + [missing_build]
                + [([str(b), "--jobs", "0"], "--jobs")] * (cmd == "rebuild-log"))
    raise AssertionError(f"no bad-flag cases for `hsbuild {cmd}`: add them to cases()")


INIT: list[Case] = [
    (["--codec", "zstd:99"], None), (["--codec", "zstd:-200000"], None), (["--codec", "blosc-lz4:99"], None),
    (["--codec", "blosc-zstd:-1"], None), (["--codec", "blosc-lz4:10"], None), (["--codec", "zstd:x"], None),
    (["--codec", "lz5"], None), (["--codec", "none:3"], None), (["--codec", ""], None),
    (["--staging", "/nonexistent"], None), (["--staging", "a-file"], None), (["--staging", ""], None),
    (["--max-attempts", "0"], None), (["--max-tokens", "0"], None),  # the first 14 also run with --force
    (["--chunk-tokens", "0"], None), (["--chunk-tokens", str(1 << 30)], None), (["--max-tokens", "-1"], None),
    (["--max-tokens", "999999"], None), (["--max-tokens", "1.5"], None), *WATERMARKS,
    (["--min-free=-5G"], "--min-free"), (["--min-free", "5X"], None), (["--dtype", "int8"], None),
    (["--device", "tpu"], None), (["--aux-layers", "x"], None), (["--aux-layers", "1,1"], None),
    (["--aux-layers", "1,2,99"], None), (["--aux-layers", "-1,2"], None), (["--model", "builtin:layers=0"], None),
    (["--model", "builtin:vocab=x"], None), (["--model", "/nonexistent-model"], None),
    (["--backend", "sglang-next"], None), (["--inflight", "0"], None), (["--server", "http://127.0.0.1:1"], None),
    (["--backend", "vllm"], None),
    (["--backend", "vllm", "--server", "127.0.0.1:8000", "--staging", "/tmp"], "--server"),
    (["--backend", "vllm", "--server", "http://127.0.0.1:8000"], None),
    (["--backend", "vllm", "--server", "http://127.0.0.1:8000", "--staging", "/tmp"], "--model"),
    (["--final-state", "middle"], None), (["--source", "/nonexistent.jsonl"], None),
    (["--quantize", "fp4"], None), (["--batch-tokens", "0"], None), (["--batch-tokens", "1.5"], None),
    (["--backend", "vllm", "--server", "http://127.0.0.1:8000", "--staging", "/tmp", "--batch-tokens", "512"],
     "--batch-tokens"),
    # regeneration (docs/regenerate.md): its flags, and --regenerate on a source without conversations
    (["--regenerate", "--max-new-tokens", "0"], "--max-new-tokens"), (["--regenerate", "--max-new-tokens", "x"],
                                                                      "--max-new-tokens"),
    (["--regenerate", "--temperature", "-1"], "--temperature"), (["--regenerate", "--temperature", "nan"],
                                                                 "--temperature"),
    (["--regenerate", "--top-p", "0"], "--top-p"), (["--regenerate", "--top-p", "1.5"], "--top-p"),
    (["--regenerate", "--seed", "-1"], "--seed"), (["--regenerate", "--seed", "x"], "--seed"),
    (["--regenerate", "--turns", "first"], "--turns"), (["--temperature", "0.5"], None),
    (["--regenerate"], "--regenerate"),
]

def subcommands() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices  # noqa: SLF001


COMMANDS = sorted(subcommands())


def _staging_relative(argv: list[str], d: Path) -> list[str]:
    return [str(d / a) if a == "a-file" else a for a in argv]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_bad_flag_values_exit_2_in_one_line_naming_the_flag_and_change_nothing(shared, cmd):
    d, b = shared
    before = digest(b)
    problems = []
    for argv, name in cases(cmd, d, b):
        argv = _staging_relative(argv, d)
        want = name or _first_flag(cmd, argv)
        rc, err = call([cmd, *argv])
        first = err.splitlines()[0] if err else ""
        if (rc != 2 or not first.startswith(f"hsbuild {cmd}: error:") or want not in first or "Traceback" in err
                or err.strip().count("\n")):
            problems.append(f"{cmd} {' '.join(argv)}: rc {rc} (want 2, naming {want!r}): {err.strip()[:300]}")
        if digest(b) != before:
            problems.append(f"{cmd} {' '.join(argv)}: changed the build")
            before = digest(b)
    for made in ("new", "demo", "out", "nope"):
        assert not (d / made).exists(), f"{made} was created"
    assert not problems, "\n".join(problems)


SETUP_FLAGS = {"--source", "--model", "--force", "--no-progress"}  # flags a case carries besides the bad one


def _first_flag(cmd: str, argv: list[str]) -> str:
    """The flag a case is about: the first one after those every case of the command carries."""
    carried = set(SETUP_FLAGS)
    if cmd in ("export", "import"):
        carried.add("--format")
    if cmd == "import":
        carried.add("--dump-layers")  # every import case names the dump's layers; its own cases say so
    flags = [a.split("=")[0] for a in argv if a.startswith("--")]
    return next((f for f in flags if f not in carried), flags[-1] if flags else argv[0])


def test_every_subcommand_and_value_flag_has_a_bad_value_case(tmp_path):
    """The parser's own list: a command, or a flag that takes a value, without a case above fails here."""
    b = tmp_path / "b"
    missing = []
    for cmd, p in subcommands().items():
        try:
            covered = {a.split("=")[0] for argv, _ in cases(cmd, tmp_path, b) for a in argv if a.startswith("--")}
        except AssertionError as e:
            missing.append(str(e))
            continue
        for action in p._actions:  # noqa: SLF001
            if action.option_strings and action.nargs != 0 and not set(action.option_strings) & covered:
                missing.append(f"hsbuild {cmd} {action.option_strings[0]}: no bad-value case")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("flags", [["--codec", "zstd:99"], ["--codec", "blosc-lz4:99"], ["--staging", "/nonexistent"]],
                         ids=["zstd-99", "blosc-99", "staging-missing"])
def test_reported_init_flags_refused_by_the_real_command(tmp_path, cli_proc, flags):
    """The cases a user hit (a ValueError traceback; 'created build' then a FileNotFoundError traceback; every
    sample failing later), through the installed entry point: exit 2, one line naming the flag, no build."""
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(2))
    cp = cli_proc("init", tmp_path / "b", "--source", src, "--model", MODEL, *flags)  # the real process
    err = cp.stderr.strip()
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert err.startswith(f"hsbuild init: error: {flags[0]} ") and "\n" not in err and "Traceback" not in err, err
    assert cp.stdout == "" and not (tmp_path / "b").exists()
