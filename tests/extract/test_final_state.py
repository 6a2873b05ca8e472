"""Both final-state conventions from one source of truth: the model's final norm, kept in the build.

Engines return the last decoder layer's output before the norm; Hugging Face's hidden_states[L] is after it.
The norm stored at init derives one from the other bit-exactly (checked against transformers itself), and
in-process builds can store either (`--final-state`)."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
from conftest import ROOMY, hsbuild, random_rows, write_jsonl

from builder.extract.final_norm import FinalNorm, read_final_norm
from builder.extract.model import Extractor
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


@pytest.fixture
def hf_llama(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # a norm weight that is not all ones, so applying it matters
        model.model.norm.weight.copy_(torch.rand(64) * 2)
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_the_stored_norm_derives_hf_post_norm_states_bit_exactly(hf_llama):
    ids = np.random.default_rng(0).integers(0, 512, size=37)
    pre_ex = Extractor(str(hf_llama), dtype="bfloat16", device="cpu", final_state="pre_norm")
    post_ex = Extractor(str(hf_llama), dtype="bfloat16", device="cpu")
    aux_pre, pre = pre_ex.extract(ids)
    aux_post, post = post_ex.extract(ids)
    assert torch.equal(aux_pre, aux_post)  # only the final state differs
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hs = m(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    assert torch.equal(post, hs[4][0])
    assert not torch.equal(pre, post)
    norm = read_final_norm(hf_llama, torch.bfloat16)
    assert norm.eps == 1e-5
    assert torch.equal(norm.apply(pre), hs[4][0]), "the derivation is bit-exact to transformers' own norm"


def test_init_keeps_the_norm_and_pre_norm_builds_store_the_layer_output(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(6, seed=2))
    pre_b = init_build(tmp_path / "pre", src, model=MODEL, watermarks=ROOMY, final_state="pre_norm").root
    post_b = init_build(tmp_path / "post", src, model=MODEL, watermarks=ROOMY, final_state="post_norm").root
    for b in (pre_b, post_b):
        assert run_build(b, RunOptions()).exit_code == 0
    with EventLog(layout(pre_b).events, read_only=True) as log:
        meta = log.meta()
    assert meta["final_state"] == "pre_norm" and meta["final_norm"]["file"] == "final_norm.safetensors"
    norm = FinalNorm.load(layout(pre_b).final_norm)
    post = {it["sample_id"]: it for it in HiddenStateDataset(post_b)}
    for it in HiddenStateDataset(pre_b):
        assert not torch.equal(it["hidden_state"], post[it["sample_id"]]["hidden_state"])
        assert torch.equal(norm.apply(it["hidden_state"]), post[it["sample_id"]]["hidden_state"])
        assert torch.equal(it["aux_hidden_state"], post[it["sample_id"]]["aux_hidden_state"])


def test_vllm_build_without_a_server_waits_then_names_the_fix(tmp_path, hf_llama, monkeypatch):
    staging = tmp_path / "staging"
    staging.mkdir()
    rows = random_rows(3, vocab=512)
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    b = tmp_path / "b"
    cp = hsbuild("init", b, "--source", src, "--model", hf_llama, "--backend", "vllm", "--server",
                 "http://127.0.0.1:9", "--staging", staging)
    assert cp.returncode == 0, cp.stderr
    # serve-command: the exact server for this build (its layers, its staging, caching off)
    cmd = shlex.split(hsbuild("serve-command", b, check=True).stdout.strip())
    assert "vllm.entrypoints.openai.api_server" in cmd and "--no-enable-prefix-caching" in cmd
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--port") + 1] == "9"
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,3,4]' in cmd[cmd.index("--speculative-config") + 1]
    assert str(staging) in cmd[cmd.index("--kv-transfer-config") + 1]
    monkeypatch.setenv("HSBUILD_SERVER_TIMEOUT", "2")
    cp = hsbuild("run", b, "--no-progress")
    assert cp.returncode == 4, cp.stderr
    last = cp.stderr.strip().splitlines()[-1]
    assert "not healthy" in last and "serve-command" in last and "Traceback" not in cp.stderr
    with EventLog(layout(b).events, read_only=True) as log:
        assert log.count("written") == 0 and log.count("started") == 0


@pytest.mark.parametrize(("stored", "build_dtype"), [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                                     ("float32", "float32")])
def test_init_keeps_the_norm_bit_exactly_whatever_dtype_the_checkpoint_stores(tmp_path, hf_llama, stored,
                                                                             build_dtype):
    """init copies the norm's bytes when the checkpoint stores it in the build's dtype (no torch), converts it
    otherwise: either way the kept norm is the one the extractor itself would read."""
    model_dir = hf_llama
    if stored == "bfloat16":
        model_dir = tmp_path / "llama-bf16"
        transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama)).to(torch.bfloat16).save_pretrained(model_dir)
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(3, vocab=512))
    b = init_build(tmp_path / "b", src, model=str(model_dir), watermarks=ROOMY, dtype=build_dtype).root
    kept = FinalNorm.load(layout(b).final_norm)
    want = read_final_norm(model_dir, getattr(torch, build_dtype))
    assert kept.weight.dtype == want.weight.dtype == getattr(torch, build_dtype)
    assert torch.equal(kept.weight, want.weight) and kept.eps == want.eps == 1e-5


def test_init_of_a_hf_model_does_not_import_torch(tmp_path, hf_llama):
    """`init` reads a Hugging Face model's config, fingerprint, tokenizer and norm without torch: its import
    costs a second of every init (checked in a fresh interpreter)."""
    bf16 = tmp_path / "llama-bf16"
    transformers.AutoModelForCausalLM.from_pretrained(str(hf_llama)).to(torch.bfloat16).save_pretrained(bf16)
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(3, vocab=512))
    code = ("import sys; from builder.cli.app import main; rc = main(['init', sys.argv[1], '--source', sys.argv[2], "
            "'--model', sys.argv[3], '--allow-overcommit']); "
            "print('torch' in sys.modules, rc)")
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cp = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b"), str(src), str(bf16)], capture_output=True,
                        text=True, timeout=120)
    assert cp.stdout.split()[-2:] == ["False", "0"], (cp.stdout, cp.stderr)
    with EventLog(layout(tmp_path / "b").events, read_only=True) as log:
        assert log.meta()["final_norm"] == {"file": "final_norm.safetensors", "eps": 1e-5}
    assert torch.equal(FinalNorm.load(layout(tmp_path / "b").final_norm).weight,
                       read_final_norm(bf16, torch.bfloat16).weight)
