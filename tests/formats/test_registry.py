"""The format seam (builder/formats/registry.py): a format is one module registered once by name, and the CLI's
choices and help, the table in docs/design.md, export, import and the dataset find it through the registry.

The proof: a toy format whose whole code is tests/formats/toy_format.py, registered with the public call (no
edit anywhere else), exports a real build through `hsbuild export` and imports it back into a fresh build through
`hsbuild import` (its files read by the run's worker processes), bit-exact."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOMY, hsbuild, hsbuild_proc, random_rows, write_jsonl

from builder.cli.app import build_parser
from builder.errors import FormatError
from builder.formats import make_format, register, registry, unregister
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

ROOT = Path(__file__).resolve().parents[2]
MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
TOY = "toy_format:ToyFormat"  # tests/formats/toy_format.py (tests/formats is on the path, the workers' too)
N = 6


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    register("toy", TOY)
    yield "toy"
    unregister("toy")


def format_choices(cmd: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return next(a for a in sub.choices[cmd]._actions if a.dest == "format").choices  # noqa: SLF001


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.contiguous().numpy()


def test_a_format_from_one_file_exports_and_imports_back_bit_exact(tmp_path, toy):
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(N, seed=5, hi=40))
    a = init_build(tmp_path / "a", src, model=MODEL, watermarks=ROOMY).root
    assert run_build(a, RunOptions(workers=1), echo=lambda m: None).written == N

    out = tmp_path / "toy-out"
    cp = hsbuild("export", a, out, "--format", "toy", "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"({toy}) into {out}: {N} sample(s) in it" in cp.stdout, cp.stdout
    assert "aux layers (HF hidden_states indices): [1, 2, 3]; final state pre-norm" in cp.stdout, cp.stdout
    assert sorted(p.name for p in (out / "samples").iterdir()) == [f"{i:05d}.safetensors" for i in range(N)]
    assert (out / "index.json").is_file()
    # the dataset yields the toy's items, as its "trainer" would read them
    ds = HiddenStateDataset(a, format=toy)
    assert set(ds[0]) == {"tokens", "states"}

    b = tmp_path / "b"
    assert hsbuild("init", b, "--source", src, "--model", MODEL, "--low", "0.997", "--high", "0.998", "--flood",
                   "0.999").returncode == 0
    cp = hsbuild("import", b, out, "--format", toy, "--no-progress")  # its layers: from the export's journal
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"imported {N} sample(s) from {N} file(s); 0 file(s) unusable" in cp.stdout, cp.stdout
    assert "dump layers: 1,2,3 (hf_hidden_states ids, from " in cp.stdout, cp.stdout

    want = {it["sample_id"]: it for it in HiddenStateDataset(a)}
    got = {it["sample_id"]: it for it in HiddenStateDataset(b)}
    assert sorted(got) == sorted(want)
    for sid, w in want.items():
        for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"):
            assert got[sid][k].dtype == w[k].dtype and np.array_equal(bits(got[sid][k]), bits(w[k])), (sid, k)
    with EventLog(layout(b).events, read_only=True) as log:
        rows = log.query_dicts("SELECT json_extract_string(detail, '$.import.format') AS f FROM events "
                               "WHERE kind = 'written'")
    assert [r["f"] for r in rows] == [toy] * N  # every sample came from the toy's files, none was extracted


def test_the_cli_the_dataset_and_init_ask_the_registry(tmp_path, toy):
    assert format_choices("export") == ["specforge", "speculators", "modelopt", "chat", toy]
    assert format_choices("import") == ["specforge", "speculators", "modelopt", "pt", toy]
    cp = hsbuild("export", "--help")
    assert "toy: samples/NNNNN.safetensors + index.json" in " ".join(cp.stdout.split()), cp.stdout
    unregister(toy)
    assert format_choices("export") == ["specforge", "speculators", "modelopt", "chat"]
    assert registry.names(imports=True) == ["specforge", "speculators", "modelopt", "pt"]
    with pytest.raises(FormatError, match=r"^--format toy: use one of specforge, speculators, modelopt, pt, chat$"):
        make_format(toy)
    # another process (the CLI, a run's workers) learns a format from the environment `register` sets
    register(toy, TOY)
    assert os.environ[registry.ENV] == f"toy={TOY}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "formats")])}
    cp = hsbuild_proc("export", "--help", env=env)
    assert cp.returncode == 0 and "{specforge,speculators,modelopt,chat,toy}" in cp.stdout, cp.stdout + cp.stderr
    # an exporting format is one `init` lists among the trainers a build feeds
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(2, seed=1))
    b = init_build(tmp_path / "b", src, model=MODEL, watermarks=ROOMY).root
    assert BuildInfo.load(layout(b)).feeds()[1] == "trainers: specforge, speculators, modelopt, toy"


def test_the_docs_table_and_the_format_lists_are_the_registrys(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    design = (ROOT / "docs" / "design.md").read_text()
    assert registry.docs_table() in design, "docs/design.md's formats table is stale: python tools/formats_table.py"
    rows = [ln for ln in design.splitlines() if re.match(r"\| `[a-z0-9_-]+` \((export|import)", ln)]
    assert [r.split("`")[1] for r in rows] == registry.names()
    docs = design + (ROOT / "README.md").read_text()
    for cmd, names in (("export", registry.names(exports=True)), ("import", registry.names(imports=True))):
        listed = re.findall(rf"hsbuild {cmd} BUILD \w+ --format (\w+(?:\|\w+)+)", docs)  # the choices listed
        assert listed and all(f == "|".join(names) for f in listed), (cmd, listed)
    cp = subprocess.run([sys.executable, str(ROOT / "tools" / "formats_table.py"), "--check"], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_format_modules_are_read_without_torch():
    """The CLI and `init` read every format's class: that imports no torch, numpy or pyarrow."""
    code = ("import sys; from builder.formats import registry; from builder.cli.app import build_parser; "
            "build_parser(); print(registry.names(), [m in sys.modules for m in ('torch', 'numpy', 'pyarrow')])")
    env = {k: v for k, v in os.environ.items() if k != registry.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=ROOT, timeout=60).stdout
    assert out.strip() == "['specforge', 'speculators', 'modelopt', 'pt', 'chat'] [False, False, False]"


def test_registrations_and_options_are_checked_in_one_line(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    with pytest.raises(FormatError, match=r"^format 'Toy' = 'toy_format': give a lowercase name and "):
        register("Toy", "toy_format")
    with pytest.raises(FormatError, match=r"^format 'specforge': registered already"):
        register("specforge", TOY)
    with pytest.raises(FormatError, match=r"cannot be unregistered"):
        unregister("pt")
    monkeypatch.setenv(registry.ENV, "nope=no_such_module:Nope")
    with pytest.raises(FormatError, match=r"^HSBUILD_FORMATS: format nope \(no_such_module:Nope\) does not load: "):
        registry.names()
    monkeypatch.setenv(registry.ENV, "wrong=builder.formats.specforge:SpecForge")
    with pytest.raises(FormatError, match=r"calls itself 'specforge'"):
        registry.get("wrong")
    monkeypatch.setenv(registry.ENV, "specforge=toy_format:ToyFormat")
    with pytest.raises(FormatError, match=r"^HSBUILD_FORMATS: 'specforge=toy_format:ToyFormat': specforge is "):
        registry.names()
    monkeypatch.delenv(registry.ENV)
    with pytest.raises(FormatError, match=r"^--compress: only --format specforge takes it \(not speculators\)$"):
        make_format("speculators", compress=3)
    with pytest.raises(FormatError, match=r"^--format pt: use one of specforge, speculators, modelopt, chat$"):
        make_format("pt", exports=True)
    with pytest.raises(FormatError, match=r"^--format chat: use one of specforge, speculators, modelopt$"):
        make_format("chat", exports=True, states=True)  # (a dataset's items, init's trainers: formats of states)
    assert make_format("pt", final_state="pre_norm").final_state == "pre_norm"
    assert make_format("specforge", final_state="pre_norm").final_state == "post_norm"  # its files always say
