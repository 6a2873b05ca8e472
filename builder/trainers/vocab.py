"""The reduced draft vocabulary EAGLE-3 trainers share: the D most frequent loss-masked target tokens, sorted by
id; `d2t[i] = used[i] - i` (int64 [D]: target id = draft id + d2t[draft id]) and `t2d[v] = v in used` (bool [V]).
SpecForge (process_token_dict_to_mappings), speculators (build_vocab_mappings_from_distribution) and
Model-Optimizer compute the same two tensors; ties go to the smaller token id here (deterministic), and when
fewer than D tokens were seen the smallest unseen ids fill up the rest."""

from __future__ import annotations

from collections import Counter

import torch

from builder.errors import FormatError


def vocab_mapping(freq: Counter[int], draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < draft_vocab_size <= vocab_size:
        raise FormatError(f"--draft-vocab-size {draft_vocab_size}: must be between 1 and the model's vocabulary "
                          f"size {vocab_size}")
    chosen = sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab_size]
    if len(chosen) < draft_vocab_size:
        have = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in have][: draft_vocab_size - len(chosen)]
    used = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d
