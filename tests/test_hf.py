"""A local Hugging Face model directory (a tiny Llama saved here with save_pretrained; no download): the stored
states equal transformers' own `output_hidden_states`, at the recorded indices, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_rows, write_jsonl

from builder.coordinator import RunOptions, run_build
from builder.events import EventLog
from builder.layout import layout
from builder.reader import HiddenStateDataset

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")


def test_hf_model_directory(tmp_path):
    from conftest import ROOMY

    from builder.build import init_build

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    rows = random_rows(5, vocab=512)
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    build = init_build(tmp_path / "b", src, model=str(model_dir), aux_layers=[1, 3, 5], watermarks=ROOMY).root
    assert run_build(build, RunOptions(progress=False, device="cpu")).exit_code == 0
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
