"""The trainer file modules on hand-made files (no build): what an import refuses before it touches a build."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from builder.errors import FormatError
from builder.formats.base import Rejected
from builder.formats.speculators import Speculators
from builder.formats.vocab import vocab_mapping


def test_an_fp8_speculators_file_is_refused_as_lossy(tmp_path):
    n, h = 5, 8
    hs = torch.randn(n, 4, h)
    scales = hs.abs().amax(dim=(1, 2), keepdim=True) / 448.0
    save_file({"hidden_states": (hs / scales).to(torch.float8_e4m3fn), "hidden_states_scales": scales,
               "token_ids": torch.arange(n)}, str(tmp_path / "hs_0.safetensors"))
    with pytest.raises(Rejected) as e:
        Speculators().load(tmp_path / "hs_0.safetensors")
    assert e.value.reason == "bad_dtype" and "FP8" in str(e.value)


def test_a_speculators_file_cut_short_is_truncated(tmp_path):
    p = tmp_path / "hs_1.safetensors"
    save_file({"hidden_states": torch.randn(6, 4, 8).to(torch.bfloat16), "token_ids": torch.arange(6)}, str(p))
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(Rejected) as e:
        Speculators().load(p)
    assert e.value.reason in ("truncated", "unreadable")


def test_vocab_mapping_fills_unseen_ids_and_refuses_impossible_sizes():
    d2t, t2d = vocab_mapping(Counter({7: 5, 3: 5, 9: 1}), 4, 10)
    used = (torch.arange(4) + d2t).tolist()
    assert used == [0, 3, 7, 9], "the seen tokens, then the smallest unseen ids, sorted"
    assert t2d.nonzero().flatten().tolist() == used
    d2t, _ = vocab_mapping(Counter({7: 5, 3: 5, 9: 1}), 2, 10)
    assert (torch.arange(2) + d2t).tolist() == [3, 7], "ties go to the smaller id, then sorted"
    with pytest.raises(FormatError):
        vocab_mapping(Counter(), 11, 10)
