"""Each trainer's vocabulary file follows that trainer's own rule, ties at the cut included, under the name it
looks for by default:

- SpecForge derives its mapping itself from the feature files (count_effective_feature_tokens walks them in
  sorted path order; process_token_dict_to_mappings keeps `Counter.most_common`'s ties: the token counted first),
  so hsbuild's `vocab_mapping/vocab_mapping.pt` is what SpecForge computes from the same export;
- speculators breaks ties to the smaller id (build_vocab_mappings_from_distribution) and, given only
  `--draft-vocab-size D`, loads `d2t-{D}.npy`/`t2d-{D}.npy` from its data path (parse_vocab_mappings).

On a tie-heavy table the two rules pick different tokens: one rule for both was wrong for one of them.
"""

from __future__ import annotations

import random
from argparse import Namespace
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOMY, write_jsonl

from builder.exchange.export import ExportOptions, export_build
from builder.formats.specforge import SpecForge
from builder.formats.vocab import specforge_counts, specforge_vocab_mapping, vocab_mapping
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
VOCAB = 1024
INSTALL = ("pip install -e .[trainers] && pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 "
           "specforge==0.2.0 nvidia-modelopt==0.47.0")


def trainer(module: str):
    return pytest.importorskip(module, reason=f"{module} is not importable; to run the trainer checks: {INSTALL}")


def tie_heavy(seed: int, n: int = 500, vocab: int = 2000) -> Counter[int]:
    """n distinct tokens with counts 1..3, inserted in a shuffled order: most of them tie with many others."""
    rng = random.Random(seed)
    tokens = rng.sample(range(vocab), n)
    return Counter({t: rng.choice((1, 1, 2, 2, 3)) for t in tokens})


def test_specforge_rule_is_specforges_own_function_on_a_tie_heavy_table():
    pre = trainer("specforge.data.preprocessing")
    spec = trainer("speculators.train.vocab_mapping")
    differ = 0
    for seed in range(3):
        table = tie_heavy(seed)
        for d in (1, 64, 250, 499, 500, 600):  # 600: more than were seen, the missing ids fill up
            want_d2t, want_t2d = pre.process_token_dict_to_mappings(Counter(table), d, 2000)
            got_d2t, got_t2d = specforge_vocab_mapping(table, d, 2000)
            assert torch.equal(got_d2t, want_d2t.long()) and torch.equal(got_t2d, want_t2d), (seed, d)
            # speculators' rule on the same table: its own function, and not SpecForge's choice
            s_d2t, s_t2d = spec.build_vocab_mappings_from_distribution(dict(table), d, 2000)
            ours_d2t, ours_t2d = vocab_mapping(table, d, 2000)
            assert torch.equal(ours_d2t, s_d2t) and torch.equal(ours_t2d, s_t2d), (seed, d)
            differ += int((got_t2d != ours_t2d).sum()) // 2
        assert table == tie_heavy(seed), "the caller's table is left as it was"
    assert differ > 100, f"the tie rules should pick differently on tie-heavy tables ({differ} ids)"


def test_specforge_counts_in_the_order_it_reads_its_files(tmp_path):
    """Rows in export order (index) are counted in SpecForge's order: its files by sorted path (data_10 before
    data_2, rows_10000-12000 before rows_2000-4000), each file's tokens by id; each file cut to max_length."""
    data = trainer("specforge.training.vocab_mapping")
    rng = np.random.default_rng(5)
    indexes = [*range(25), 1999, 2000, 2001, 2010, 4000, 10000, 10001, 20000]
    rows = []
    fmt = SpecForge()
    for i in indexes:
        n = int(rng.integers(3, 30))
        ids = rng.integers(0, 40, size=n).tolist()  # a small alphabet: every token is in many files
        mask = (rng.random(n) < 0.7).astype(int).tolist()
        rows.append((i, ids, mask))
        path = tmp_path / "out" / fmt.path_for(i)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}, path)
    for max_len in (None, 8):
        want = data.count_effective_feature_tokens(str(tmp_path / "out"), max_length=max_len, target_vocab_size=64)
        got = specforge_counts(iter(rows), fmt.path_for, 64, max_len)
        assert list(got.items()) == list(want.items()), max_len  # the same counts, inserted in the same order


def test_a_tie_heavy_export_carries_the_trainers_own_mappings(tmp_path):
    """A build whose loss-masked tokens tie a lot, exported for SpecForge and speculators with a draft vocabulary:
    SpecForge's own derivation from the exported files gives hsbuild's vocab_mapping.pt; speculators' train CLI
    finds d2t-{D}.npy/t2d-{D}.npy under its default names and loads exactly its own mapping."""
    assess = trainer("specforge.training.vocab_mapping")
    pre = trainer("specforge.data.preprocessing")
    cli = trainer("speculators.train.cli")
    spec_vocab = trainer("speculators.train.vocab_mapping")
    rng = np.random.default_rng(9)
    rows = []
    for i in range(30):
        n = int(rng.integers(6, 30))
        rows.append({"id": f"s{i}", "input_ids": rng.integers(3, VOCAB, size=n).tolist(),
                     "loss_mask": (rng.random(n) < 0.8).astype(int).tolist()})
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    b = init_build(tmp_path / "b", src, model=MODEL, watermarks=ROOMY).root
    assert run_build(b, RunOptions(workers=1), echo=lambda m: None).written == 30
    d = 100
    out = tmp_path / "sf"
    export_build(b, out, ExportOptions(format="specforge", draft_vocab_size=d))
    counts = assess.count_effective_feature_tokens(str(out), max_length=2048, target_vocab_size=VOCAB)
    assert sum(1 for c in counts.values() if c == 1) > d, "the cut falls inside a tie"
    want_d2t, want_t2d = pre.process_token_dict_to_mappings(counts, d, VOCAB)
    vm = torch.load(out / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert torch.equal(vm["d2t"], want_d2t.long()) and torch.equal(vm["t2d"], want_t2d)

    out = tmp_path / "spec"
    export_build(b, out, ExportOptions(format="speculators", draft_vocab_size=d))
    assert not (out / "d2t.npy").exists()
    args = Namespace(d2t_path=None, t2d_path=None, data_path=str(out), draft_vocab_size=d, token_freq_path=None,
                     verifier_name_or_path=None, trust_remote_code=False)
    d2t, t2d, size = cli.parse_vocab_mappings(args)  # finds the files by its default names: no regeneration
    assert size == d
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    s_d2t, s_t2d = spec_vocab.build_vocab_mappings_from_distribution(freq, d, VOCAB)
    assert torch.equal(d2t, s_d2t) and torch.equal(t2d, s_t2d)
    assert not torch.equal(t2d, vm["t2d"]), "on this tie-heavy set the trainers' rules pick differently"
    assert sorted(p.name for p in Path(out).glob("*.npy")) == [f"d2t-{d}.npy", f"t2d-{d}.npy"]
