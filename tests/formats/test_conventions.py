"""Each trainer's layer numbering and final-state convention, checked against a transformers forward of the same
model: what hsbuild exports (and yields as that trainer's item) for "aux layer k" is the tensor that trainer's own
producer would have captured, and the final state is after the norm for SpecForge / Model-Optimizer and before
it for speculators.

- SpecForge / Model-Optimizer: aux id k = the output of decoder layer k = Hugging Face hidden_states[k+1];
  `hidden_state` / `hidden_states` = hidden_states[L] (after the final norm).
- speculators (vLLM extract_hidden_states): layer id k = hidden_states[k] for k < L; the last slot is decoder
  layer L-1's output BEFORE the norm (the trainer applies the verifier's norm).

Also: speculators reads a build directly through `HsbuildTransfer` (its pluggable hs_connectors loader), equal
to reading the exported files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ROOMY, write_jsonl

from builder.exchange.export import ExportOptions, export_build
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")

L = 6
AUX_HF = [2, 3, 5]  # Hugging Face hidden_states indices given to init (not the defaults: a mix-up shows)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "llama"
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.rand(64) * 2)  # a norm that changes the state
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def builds(hf_model, tmp_path_factory):
    """The same rows in a post_norm and a pre_norm build, run; and the reference states from transformers."""
    tmp = tmp_path_factory.mktemp("builds")
    rng = np.random.default_rng(4)
    rows = [{"id": f"r{i}", "input_ids": rng.integers(0, 300, size=int(rng.integers(5, 40))).tolist()}
            for i in range(5)]
    src = write_jsonl(tmp / "src.jsonl", rows)
    out = {}
    for fs in ("post_norm", "pre_norm"):
        b = init_build(tmp / fs, src, model=str(hf_model), aux_layers=AUX_HF, watermarks=ROOMY, final_state=fs,
                       device="cpu").root
        assert run_build(b, RunOptions(workers=1), echo=lambda m: None).written == 5
        out[fs] = b
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the worker's count (cpu_count // workers on these machines): same bits
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(str(hf_model), dtype=torch.bfloat16).eval()
        captured = []
        hook = m.model.layers[-1].register_forward_hook(
            lambda mod, inp, o: captured.append((o[0] if isinstance(o, tuple) else o)[0]))
        ref = {}
        with torch.no_grad():
            for r in rows:
                captured.clear()
                hs = m(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
                ref[r["id"]] = {"hs": [h[0] for h in hs], "pre": captured[0]}
        hook.remove()
    finally:
        torch.set_num_threads(threads)
    return out, ref, tmp


def _by_id(ds: HiddenStateDataset) -> dict:
    return {e["sample_id"]: i for i, e in enumerate(ds.index)}


def test_specforge_and_modelopt_count_decoder_layers_and_keep_the_post_norm_state(builds):
    b, ref, tmp = builds
    for fs in ("post_norm", "pre_norm"):  # a pre-norm build derives the post-norm state bit-exactly
        for fmt, aux_key, final_key in (("specforge", "hidden_state", "target"),
                                        ("modelopt", "aux_hidden_states", "base_model_hidden_states")):
            rep = export_build(b[fs], tmp / f"{fmt}-{fs}", ExportOptions(format=fmt))
            assert rep.layer_ids == [k - 1 for k in AUX_HF], "decoder-layer ids: HF index - 1"
            ds = HiddenStateDataset(b[fs], format=fmt)
            for sid, i in _by_id(ds).items():
                item = ds[i]
                aux, final = item[aux_key].reshape(-1, 3 * 64), item[final_key].reshape(-1, 64)
                hs = ref[sid]["hs"]
                want_aux = torch.cat([hs[k + 1] for k in rep.layer_ids], dim=-1)
                n = aux.shape[0]
                assert torch.equal(aux, want_aux[:n]), f"{fmt} {fs} {sid}: aux != hidden_states[k+1]"
                assert torch.equal(final, hs[L][:n]), f"{fmt} {fs} {sid}: final != hidden_states[L] (post-norm)"


def test_speculators_uses_vllm_ids_and_the_pre_norm_state(builds):
    b, ref, tmp = builds
    rep = export_build(b["pre_norm"], tmp / "spec", ExportOptions(format="speculators"))
    assert rep.layer_ids == AUX_HF, "vLLM layer id k = hidden_states[k]"
    ds = HiddenStateDataset(b["pre_norm"], format="speculators")
    for sid, i in _by_id(ds).items():
        item = ds[i]
        hs = ref[sid]["hs"]
        assert torch.equal(item["hidden_states"], torch.cat([hs[k] for k in rep.layer_ids], dim=-1))
        assert torch.equal(item["verifier_last_hidden_states"], ref[sid]["pre"]), "the last layer's output, pre-norm"
        assert not torch.equal(item["verifier_last_hidden_states"], hs[L])


def test_speculators_reads_a_build_directly_through_its_transfer_plugin(builds):
    pytest.importorskip("hs_connectors", reason="needs speculators: pip install -e .[trainers] && pip install "
                                                "--no-deps speculators==0.9.0 hs-connectors==0.9.0")
    data = pytest.importorskip("speculators.train.data", reason="needs speculators (see the trainers extra)")
    from builder.reader.speculators_transfer import HsbuildTransfer

    b, _, tmp = builds
    # speculators' own dataset directory: the Arrow rows of an export (the same rows, in source order)
    dataset = tmp / "spec-src"
    export_build(b["pre_norm"], dataset, ExportOptions(format="speculators"))
    # a build made FROM that directory (row i = sample "i"), with only some rows extracted so far
    src_build = init_build(tmp / "from-dir", dataset, model=str(ds_model(b["pre_norm"])), aux_layers=AUX_HF,
                           watermarks=ROOMY, final_state="pre_norm", device="cpu").root
    run_build(src_build, RunOptions(workers=1, limit=3), echo=lambda m: None)
    files = data.ArrowDataset(max_len=4096, datapath=str(dataset), on_missing="raise")
    direct = data.ArrowDataset(max_len=4096, datapath=str(dataset), transfer=HsbuildTransfer(src_build),
                               on_missing="skip")
    got = 0
    for i in range(len(files)):
        item = direct[i]
        if type(item).__name__ == "SampleUnavailable":
            continue
        want = files[i]
        assert item.keys() == want.keys()
        assert all(torch.equal(item[k], want[k]) for k in want), f"row {i}"
        got += 1
    assert got == 3, "exactly the rows the build holds come from it; the others are unavailable (on_missing)"


def ds_model(build) -> str:
    from builder.config import load_config
    from builder.layout import layout

    return load_config(layout(build)).model
