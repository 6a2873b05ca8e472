"""Defaults that serve every trainer.

- A new build stores the final state BEFORE the norm (`pre_norm`) unless told otherwise: speculators reads it as
  stored, SpecForge and Model-Optimizer read the post-norm state derived from it with the kept final norm
  (bit-exactly; the reverse is impossible). `init` says which trainers a build feeds, and names the flag for the
  one it cannot. Where the model's norm cannot be kept, an in-process build falls back to `post_norm` and says so.
- A default build exports to all three trainers, and each trainer's own loader reads what the build yields.
- Aux layers: from 7 layers on hsbuild's default is each trainer's own; below that no trainer's default is usable
  (speculators refuses its own, Model-Optimizer's has fewer than three layers), so init and export name the
  flag each trainer needs, and each trainer accepts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOMY, hsbuild, write_jsonl

from builder.config import load_config
from builder.exchange.export import ExportOptions, export_build
from builder.formats import registry
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

SMALL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
DEEP = "builtin:hidden=64,layers=8,vocab=1024,heads=2,kv_heads=1,intermediate=128"
TRAINERS = ("specforge", "speculators", "modelopt")  # the formats hsbuild exports to, in the registry's order
INSTALL = ("pip install -e .[trainers] && pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 "
           "specforge==0.2.0 nvidia-modelopt==0.47.0")


def trainer(module: str):
    return pytest.importorskip(module, reason=f"{module} is not importable; to run the trainer checks: {INSTALL}")


def rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(6, 50))
        out.append({"id": f"r{i}", "input_ids": rng.integers(3, 1024, size=k).tolist(),
                    "loss_mask": [0] * (k // 3) + [1] * (k - k // 3)})
    return out


@pytest.fixture(scope="module")
def default_build(tmp_path_factory) -> Path:
    """A build made with no --final-state (and the default aux layers of a 4-layer model), run."""
    base = tmp_path_factory.mktemp("defaults")
    src = write_jsonl(base / "src.jsonl", rows(12, seed=3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSBUILD_CACHE_DIR", str(base / "cache"))
        b = init_build(base / "b", src, model=SMALL, watermarks=ROOMY).root
        assert run_build(b, RunOptions(workers=1), echo=lambda m: None).written == 12
    return b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), f"{where}: {k}"
            assert torch.equal(_bits(g), _bits(w)), f"{where}: {k} differs"
        else:
            assert g == w, f"{where}: {k}"


def by_tokens(items) -> dict[tuple, dict]:
    return {tuple(it["input_ids"].reshape(-1).tolist()): it for it in items}


def test_a_default_build_stores_pre_norm_and_keeps_the_norm(default_build):
    info = BuildInfo.load(layout(default_build))
    assert info.final_state == "pre_norm" and info.norm_file is not None
    assert load_config(layout(default_build)).final_state == "pre_norm"
    assert info.trainers() == {t: None for t in TRAINERS}
    assert "default" in info.final_state_why


def test_a_default_build_exports_to_every_trainer_and_each_loader_reads_it(default_build, tmp_path):
    pre = trainer("specforge.data.preprocessing")
    data = trainer("speculators.train.data")
    utils = trainer("modelopt.torch.speculative.eagle.utils")
    reports = {fmt: export_build(default_build, tmp_path / fmt, ExportOptions(format=fmt)) for fmt in TRAINERS}
    assert all(r.complete and r.exported == 12 for r in reports.values()), reports

    want = by_tokens(HiddenStateDataset(default_build, format="specforge", max_len=2048))
    ds = pre.build_offline_eagle3_dataset(str(tmp_path / "specforge"), max_len=2048)
    got = by_tokens(ds[i] for i in range(len(ds)))
    assert sorted(got) == sorted(want)
    for k, it in got.items():
        assert_same(it, want[k], "specforge")

    want = by_tokens(HiddenStateDataset(default_build, format="speculators"))
    ds = data.ArrowDataset(max_len=4096, datapath=str(tmp_path / "speculators"), on_missing="raise")
    got = by_tokens(ds[i] for i in range(len(ds)))
    assert sorted(got) == sorted(want)
    for k, it in got.items():
        assert_same(it, want[k], "speculators")

    want = by_tokens(HiddenStateDataset(default_build, format="modelopt"))
    files = sorted(str(p) for p in (tmp_path / "modelopt").rglob("*.pt"))
    ds = utils.OfflineSupervisedDataset(files, answer_only_loss=True)
    got = by_tokens(ds[i] for i in range(len(ds)))
    assert sorted(got) == sorted(want)
    for k, it in got.items():
        assert_same(it, want[k], "modelopt")

    # speculators gets the stored state; the others the post-norm state derived from it with the kept norm
    info = BuildInfo.load(layout(default_build))
    raw = HiddenStateDataset(default_build)
    for i in range(len(raw)):
        stored = raw[i]["hidden_state"]
        assert torch.equal(HiddenStateDataset(default_build, format="speculators")[i]["verifier_last_hidden_states"],
                           stored)
        assert torch.equal(HiddenStateDataset(default_build, format="modelopt")[i]["base_model_hidden_states"],
                           info.norm.apply(stored))


def test_init_says_which_trainers_a_build_feeds(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", rows(3, seed=1))
    cp = hsbuild("init", tmp_path / "a", "--source", src, "--model", DEEP, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert any(ln.startswith("final state: pre_norm") for ln in lines), cp.stdout
    assert "trainers: specforge, speculators, modelopt" in lines, cp.stdout
    assert "aux layers" not in cp.stdout, "an 8-layer model's default layers are every trainer's own"

    cp = hsbuild("init", tmp_path / "b", "--source", src, "--model", DEEP, "--final-state", "post_norm",
                 "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    assert "trainers: specforge, modelopt" in cp.stdout.splitlines(), cp.stdout
    [why] = [ln for ln in cp.stdout.splitlines() if "not speculators" in ln]
    assert "--final-state pre_norm" in why

    cp = hsbuild("init", tmp_path / "c", "--source", src, "--model", SMALL, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    assert "trainers: specforge, speculators, modelopt" in cp.stdout.splitlines(), cp.stdout
    assert "model.aux_hidden_state_layer_ids=[0,1,2]" in cp.stdout and "--target-layer-ids 1 2 3" in cp.stdout
    assert "eagle_aux_hidden_state_layer_ids: [0, 1, 2]" in cp.stdout


def test_the_trainer_tables_are_the_trainers_own(monkeypatch):
    """Each format's `default_layers` is its trainer's own default, computed by its own code."""
    providers = trainer("specforge.algorithms.model_providers")
    mutils = trainer("speculators.models.utils")
    eagle = trainer("modelopt.torch.speculative.plugins.hf_eagle")
    assert registry.names(exports=True, states=True) == list(TRAINERS)
    default = {name: registry.get(name).default_layers for name in TRAINERS}
    for n in range(4, 81):
        cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
        assert providers.resolve_eagle_capture_layers(cfg, {}, SimpleNamespace(num_hidden_layers=n)) == \
            default["specforge"](n)
        assert eagle.default_eagle_aux_layer_ids(n) == default["modelopt"](n)
        monkeypatch.setattr(mutils, "get_verifier_config", lambda *a, n=n, **k: SimpleNamespace(num_hidden_layers=n))
        if n >= 7:
            with pytest.warns(UserWarning):
                assert mutils.resolve_target_layer_ids(None, "verifier") == default["speculators"](n)
        else:  # its own default is refused below 7 layers
            with pytest.raises(ValueError, match="--target-layer-ids"):
                mutils.resolve_target_layer_ids(None, "verifier")


@pytest.mark.parametrize(("model", "layers"), [(SMALL, 4), (DEEP, 8)])
def test_exports_name_the_layer_flag_each_trainer_needs_and_the_trainers_take_it(tmp_path, monkeypatch, model,
                                                                                 layers):
    providers = trainer("specforge.algorithms.model_providers")
    mutils = trainer("speculators.models.utils")
    eagle = trainer("modelopt.torch.speculative.plugins.hf_eagle")
    src = write_jsonl(tmp_path / "src.jsonl", rows(2, seed=4))
    b = init_build(tmp_path / "b", src, model=model, watermarks=ROOMY).root
    assert run_build(b, RunOptions(workers=1), echo=lambda m: None).written == 2
    info = BuildInfo.load(layout(b))
    ids = {t: info.layer_ids()[registry.get(t).layer_convention][:-1] for t in TRAINERS}
    monkeypatch.setattr(mutils, "get_verifier_config", lambda *a, **k: SimpleNamespace(num_hidden_layers=layers))
    target = SimpleNamespace(num_hidden_layers=layers)
    for fmt in TRAINERS:
        rep = export_build(b, tmp_path / fmt, ExportOptions(format=fmt))
        assert rep.layer_flag == info.layer_flag(fmt)
        if layers >= 7:  # each trainer's default is the build's layers: nothing to tell
            assert rep.layer_flag is None
            continue
        assert rep.layer_flag is not None
        flag_ids = [int(x) for x in rep.layer_flag.replace("[", " ").replace("]", " ").replace(",", " ").split()
                    if x.lstrip("-").isdigit()]
        assert flag_ids == ids[fmt], (fmt, rep.layer_flag)
        if fmt == "speculators":  # the export command prints it (the same line for every format)
            cp = hsbuild("export", b, tmp_path / f"cli-{fmt}", "--format", fmt, "--no-progress")
            assert cp.returncode == 0 and f"{fmt} must be told these layers: {rep.layer_flag}" in cp.stdout, cp.stdout
    if layers >= 7:
        return
    # the named layers are accepted by each trainer, its default is not the build's
    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=ids["specforge"]))
    assert providers.resolve_eagle_capture_layers(cfg, {}, target) == ids["specforge"]
    none = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    assert providers.resolve_eagle_capture_layers(none, {}, target) != ids["specforge"]
    assert mutils.resolve_target_layer_ids(ids["speculators"], "verifier") == ids["speculators"]
    with pytest.raises(ValueError):
        mutils.resolve_target_layer_ids(None, "verifier")
    assert len(eagle.default_eagle_aux_layer_ids(layers)) < len(ids["modelopt"]), "its default: fewer layers"


# -- Hugging Face models: pre_norm where the norm can be kept, post_norm (said) where it cannot ---------------

@pytest.fixture
def hf_llama(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_hf_models_default_to_pre_norm_where_the_norm_can_be_kept(tmp_path, hf_llama, monkeypatch):
    monkeypatch.setenv("HSBUILD_CACHE_DIR", str(tmp_path / "cache"))
    src = write_jsonl(tmp_path / "s.jsonl", [{"input_ids": [1, 2, 3, 4]}])
    cp = hsbuild("init", tmp_path / "a", "--source", src, "--model", hf_llama, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    assert "trainers: specforge, speculators, modelopt" in cp.stdout.splitlines(), cp.stdout
    assert BuildInfo.load(layout(tmp_path / "a")).final_state == "pre_norm"

    # a model whose final norm cannot be kept (not an RMSNorm: no epsilon in its config)
    cfg = json.loads((hf_llama / "config.json").read_text())
    del cfg["rms_norm_eps"]
    (hf_llama / "config.json").write_text(json.dumps(cfg))
    cp = hsbuild("init", tmp_path / "b", "--source", src, "--model", hf_llama, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    info = BuildInfo.load(layout(tmp_path / "b"))
    assert info.final_state == "post_norm" and info.norm_file is None
    [line] = [ln for ln in cp.stdout.splitlines() if ln.startswith("final state:")]
    assert "post_norm" in line and "final norm cannot be kept" in line and "rms_norm_eps" in line, line
    assert "trainers: specforge, modelopt" in cp.stdout.splitlines() and "not speculators" in cp.stdout
    # asked for, pre_norm is still made (it feeds speculators only, and says so)
    cp = hsbuild("init", tmp_path / "c", "--source", src, "--model", hf_llama, "--final-state", "pre_norm",
                 "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    assert "trainers: speculators" in cp.stdout.splitlines() and "not specforge" in cp.stdout, cp.stdout
