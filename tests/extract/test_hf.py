"""A local Hugging Face model directory (a tiny Llama saved here with save_pretrained; no download): the stored
states equal transformers' own `output_hidden_states`, at the recorded indices, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_rows, write_jsonl

from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")


def test_hf_model_directory(tmp_path):
    from conftest import ROOMY

    from builder.run.create import init_build

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    rows = random_rows(5, vocab=512)
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    build = init_build(tmp_path / "b", src, model=str(model_dir), aux_layers=[1, 3, 5], watermarks=ROOMY,
                       final_state="post_norm").root  # (compared with hidden_states[L] below)
    assert run_build(build, RunOptions(device="cpu")).exit_code == 0
    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
    assert meta["aux_layers"] == [1, 3, 5] and meta["num_layers"] == 6 and meta["hidden_size"] == 64

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ds = HiddenStateDataset(build)
    assert len(ds) == 5
    for item, row in zip(ds, rows, strict=True):
        with torch.no_grad():
            hs = ref(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in (1, 3, 5)], dim=-1)
        assert np.array_equal(item["aux_hidden_state"].view(torch.int16).numpy(), aux.view(torch.int16).numpy())
        assert np.array_equal(item["hidden_state"].view(torch.int16).numpy(), hs[6][0].view(torch.int16).numpy())


def test_init_reads_only_the_config_of_a_hf_model(tmp_path, cli):
    """init (and doctor) must not load a large model's weights: a directory whose weight file is garbage still
    initialises; the run's workers then fail to load it, with a clear error, and nothing is written."""
    model_dir = tmp_path / "big-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama", "text_config": {"num_hidden_layers": 61, '
                                          '"hidden_size": 7168, "vocab_size": 163840}}')
    (model_dir / "model.safetensors").write_bytes(b"not weights")
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(3))
    cp = cli("init", tmp_path / "b", "--source", src, "--model", model_dir, "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    with EventLog(layout(tmp_path / "b").events, read_only=True) as log:
        meta = log.meta()
    assert (meta["num_layers"], meta["hidden_size"], meta["aux_layers"]) == (61, 7168, [2, 30, 58])
    cp = cli("run", tmp_path / "b", "--no-progress", "--device", "cpu", "--allow-overcommit", "--high", "0.999",
             "--low", "0.998", "--flood", "0.9995")
    assert cp.returncode == 2 and "cannot load" in cp.stderr, cp.stderr
    cp = cli("sql", tmp_path / "b", "SELECT count(*) AS n FROM events WHERE kind = 'written'", "--json")
    assert cp.stdout.strip() == '[{"n": 0}]'
