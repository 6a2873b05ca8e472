"""A Hugging Face model's language-model head runs on the last position only: its logits are not wanted (an
[n, vocab] float tensor a sample, 2 GB for 4k tokens of a 128k vocabulary). The stored states are exactly those
of a plain `output_hidden_states` forward pass, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.extract.model import Extractor


def test_the_head_sees_one_position_and_the_states_are_unchanged(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = transformers.LlamaConfig(vocab_size=700, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    ex = Extractor(str(tmp_path / "m"), aux_layers=[1, 2, 3], device="cpu")
    seen: list[tuple[int, ...]] = []
    ex._model.lm_head.register_forward_hook(lambda _m, inp, _out: seen.append(tuple(inp[0].shape)))
    ids = np.random.default_rng(2).integers(3, 700, size=57)
    aux, final = ex.extract(ids)
    assert seen == [(1, 1, 64)], seen  # one position, not 57

    with torch.inference_mode():  # the plain call: logits for every position
        states = ex._model(input_ids=torch.from_numpy(ids).unsqueeze(0), output_hidden_states=True).hidden_states
    assert seen[-1] == (1, 57, 64)
    want_aux = torch.cat([states[i][0] for i in (1, 2, 3)], dim=-1)
    assert torch.equal(aux.view(torch.int16), want_aux.view(torch.int16))
    assert torch.equal(final.view(torch.int16), states[4][0].view(torch.int16))
