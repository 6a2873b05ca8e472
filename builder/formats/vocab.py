"""The reduced draft vocabulary EAGLE-3 trainers share: the D most frequent loss-masked target tokens, sorted by
id; `d2t[i] = used[i] - i` (int64 [D]: target id = draft id + d2t[draft id]) and `t2d[v] = v in used` (bool [V]).

The trainers agree on that, not on ties at the cut, so each trainer's file follows its own rule:

- speculators (train/vocab_mapping.py, build_vocab_mappings_from_distribution) and Model-Optimizer's d2t:
  `vocab_mapping`: ties to the smaller token id; when fewer than D tokens were seen, the smallest unseen ids
  below D fill up the rest.
- SpecForge (data/preprocessing.py, process_token_dict_to_mappings, over training/vocab_mapping.py
  count_effective_feature_tokens): `Counter.most_common(D)`, so ties go to the token counted FIRST, walking its
  feature files in sorted path order (and each file's tokens in ascending id order), each file cut to
  `data.max_length`; too few seen: ids below D taken in the order of a Python set difference.
  `specforge_counts` counts in that order and `specforge_vocab_mapping` is that function (without its prints).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import torch

from builder.errors import FormatError


def _check(draft_vocab_size: int, vocab_size: int) -> None:
    if not 0 < draft_vocab_size <= vocab_size:
        raise FormatError(f"--draft-vocab-size {draft_vocab_size}: must be between 1 and the model's vocabulary "
                          f"size {vocab_size}")


def _mapping(chosen: Iterable[int], draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def vocab_mapping(freq: Counter[int], draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' rule (and Model-Optimizer's file): ties to the smaller id."""
    _check(draft_vocab_size, vocab_size)
    chosen = sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab_size]
    if len(chosen) < draft_vocab_size:
        have = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in have][: draft_vocab_size - len(chosen)]
    return _mapping(chosen, draft_vocab_size, vocab_size)


def specforge_vocab_mapping(token_dict: Counter[int], draft_vocab_size: int,
                            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge 0.2.0's process_token_dict_to_mappings, step for step: its ties depend on `token_dict`'s order
    (`specforge_counts` gives the order SpecForge counts in). `token_dict` is not changed."""
    _check(draft_vocab_size, vocab_size)
    token_dict = Counter(token_dict)  # SpecForge adds the missing ids to the caller's counter: not here
    if len(token_dict) < draft_vocab_size:
        existing_tokens = set(token_dict.keys())
        missing_tokens = set(range(draft_vocab_size)) - existing_tokens
        for token in missing_tokens:  # a set's order, as SpecForge's
            token_dict[token] = 0
            if len(token_dict) >= draft_vocab_size:
                break
    top_n = token_dict.most_common(draft_vocab_size)
    return _mapping([key for key, _ in top_n], draft_vocab_size, vocab_size)


def specforge_counts(rows: Iterable[tuple[int, list[int], list[int]]], path_of: Callable[[int], str],
                     vocab_size: int, max_len: int | None = None) -> Counter[int]:
    """Loss-masked token counts of the export's rows (index, input_ids, loss_mask), in the order SpecForge's
    count_effective_feature_tokens inserts them: files by sorted path (`path_of(index)`, relative to the export),
    then each file's tokens by ascending id; each row cut to `max_len` tokens first (its data.max_length).

    Streams the rows once: for each token, its count and the smallest path that holds it (numpy, V entries)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    first = np.full(vocab_size, -1, dtype=np.int64)  # the row (by arrival) whose path is the smallest holding it
    paths: list[str] = []
    for index, ids, mask in rows:
        a, m = np.asarray(ids, dtype=np.int64), np.asarray(mask)
        if max_len is not None:
            a, m = a[:max_len], m[:max_len]
        masked = a[m != 0]
        if not masked.size:
            continue
        if int(masked.min()) < 0 or int(masked.max()) >= vocab_size:
            raise FormatError(f"sample {index}: a loss-masked token id outside the vocabulary of {vocab_size}")
        tokens, n = np.unique(masked, return_counts=True)
        counts[tokens] += n
        path = path_of(index)
        k = len(paths)
        paths.append(path)
        held = first[tokens]
        new = held < 0
        first[tokens[new]] = k
        older = tokens[~new]
        if older.size:  # rows arrive in export order, not path order: keep the smaller path
            later = [j for j in np.unique(held[~new]).tolist() if path < paths[j]]
            if later:
                first[older[np.isin(held[~new], later)]] = k
    seen = np.flatnonzero(counts)
    rank = {j: r for r, j in enumerate(sorted(set(first[seen].tolist()), key=paths.__getitem__))}
    order = sorted(seen.tolist(), key=lambda t: (rank[int(first[t])], t))
    return Counter({t: int(counts[t]) for t in order})
