"""Batched extraction (`--batch-tokens`): several samples in one packed forward pass give every sample exactly the
states its own forward pass gives it, bit for bit, on the built-in model and on a Hugging Face Llama; a sample
with non-finite states fails alone; the in-process backend forms batches within the token bound; a run with
batching stores what a run without it stores."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import random_rows, write_jsonl

from builder.config import BuildConfig
from builder.errors import SampleError
from builder.extract.backends.base import Failure, Request, States
from builder.extract.backends.inprocess import BATCH_SAMPLES, InProcessBackend
from builder.extract.model import Extractor
from builder.layout import layout
from builder.reader import HiddenStateDataset

SMALL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def batches(vocab: int, seed: int, count: int) -> list[list[np.ndarray]]:
    """Random batches of 2-10 samples: lengths 1, 2, 3 (the kernels' small-size paths) and up to 300."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = [int(rng.choice([1, 2, 3, rng.integers(1, 40), rng.integers(1, 300)]))
                   for _ in range(int(rng.integers(2, 11)))]
        out.append([rng.integers(3, vocab, size=n) for n in lengths])
    return out


def assert_batches_exact(ex: Extractor, threads: tuple[int, ...] = (1, 2), count: int = 4) -> int:
    assert ex.can_pack()
    default, checked = torch.get_num_threads(), 0
    try:
        for t in threads:
            torch.set_num_threads(t)
            for batch in batches(ex.vocab_size, seed=t, count=count):
                got = ex.extract_batch(batch)
                assert len(got) == len(batch)
                for ids, g in zip(batch, got, strict=True):
                    aux, final = ex.extract(ids)
                    assert not isinstance(g, Exception), g
                    lens = [len(x) for x in batch]
                    assert same(g[0], aux), f"aux_hidden_state of a {len(ids)}-token sample in {lens}, {t} threads"
                    assert same(g[1], final), f"hidden_state of a {len(ids)}-token sample in {lens}, {t} threads"
                    checked += 1
    finally:
        torch.set_num_threads(default)
    return checked


@pytest.mark.parametrize("spec,dtype,final_state", [
    ("builtin", "bfloat16", "post_norm"),
    (SMALL, "bfloat16", "pre_norm"),
    ("builtin:hidden=96,layers=4,heads=3,kv_heads=3,intermediate=200", "bfloat16", "post_norm"),
    (SMALL, "float16", "post_norm"),
    (SMALL, "float32", "pre_norm"),
], ids=["default-bf16", "gqa-pre-norm", "mha-odd-sizes", "fp16", "fp32"])
def test_builtin_batches_equal_lone_passes_bit_for_bit(spec, dtype, final_state):
    ex = Extractor(spec, dtype=dtype, device="cpu", final_state=final_state)
    assert assert_batches_exact(ex, count=3 if spec == "builtin" else 4) > 20


def test_a_nonfinite_sample_fails_alone():
    ex = Extractor(SMALL + ",nan_token=7", device="cpu")
    rng = np.random.default_rng(3)
    batch = [rng.integers(8, 1024, size=n) for n in (5, 40, 17, 9)]
    batch[2][4] = 7  # its embedding is NaN: this sample's states are not finite, the others' are
    got = ex.extract_batch(batch)
    with pytest.raises(SampleError) as lone:
        ex.extract(batch[2])
    assert isinstance(got[2], SampleError) and got[2].reason == "nonfinite" and str(got[2]) == str(lone.value)
    for i in (0, 1, 3):
        aux, final = ex.extract(batch[i])
        assert same(got[i][0], aux) and same(got[i][1], final)


def test_a_pass_that_raises_falls_back_to_one_sample_at_a_time(monkeypatch):
    ex = Extractor(SMALL, device="cpu")
    rng = np.random.default_rng(4)
    batch = [rng.integers(3, 1024, size=n) for n in (6, 30, 11)]
    want = [ex.extract(ids) for ids in batch]

    def boom(*_a, **_k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ex._model, "forward_packed", boom)
    got = ex.extract_batch(batch)
    for g, (aux, final) in zip(got, want, strict=True):
        assert same(g[0], aux) and same(g[1], final)


# -- a Hugging Face Llama ------------------------------------------------------------------------------------

def _llama(path, heads: int, kv_heads: int):
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("heads,kv_heads,final_state", [(4, 2, "post_norm"), (2, 2, "pre_norm")],
                         ids=["gqa", "mha-pre-norm"])
def test_hf_llama_batches_equal_lone_passes_bit_for_bit(tmp_path, heads, kv_heads, final_state):
    path = _llama(tmp_path / "llama", heads, kv_heads)
    ex = Extractor(str(path), aux_layers=[1, 2, 4], device="cpu", final_state=final_state)
    assert assert_batches_exact(ex, count=3) > 10


def test_hf_models_other_than_llama_run_one_at_a_time(tmp_path, monkeypatch):
    path = _llama(tmp_path / "llama", 2, 1)
    ex = Extractor(str(path), aux_layers=[1, 2, 4], device="cpu")
    monkeypatch.setattr(ex._model.config, "_attn_implementation", "eager")  # eager: a lone pass builds a mask
    assert not ex.can_pack()
    batch = [np.arange(3, 3 + n) for n in (4, 9)]
    for g, ids in zip(ex.extract_batch(batch), batch, strict=True):
        aux, final = ex.extract(ids)
        assert same(g[0], aux) and same(g[1], final)


# -- the backend --------------------------------------------------------------------------------------------

def _requests(lengths: list[int], seed: int = 5, nan_at: int | None = None) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(8, 1024, size=n)
        if i == nan_at:
            ids[0] = 7
        out.append(Request(f"s{i}", ids))
    return out


def test_backend_one_at_a_time_by_default():
    b = InProcessBackend(Extractor(SMALL, device="cpu"))
    assert b.capacity == 1
    b.submit(_requests([5])[0])
    got = b.collect(0.0)  # computes at once, as before
    assert [type(o) for o in got] == [States] and b.in_flight() == 0


def test_backend_batches_within_the_token_bound_and_fails_samples_alone():
    ex = Extractor(SMALL + ",nan_token=7", device="cpu")
    b = InProcessBackend(ex, batch_tokens=100)
    assert b.capacity == 6  # two batches of 32-token samples
    reqs = _requests([30, 40, 20, 50, 150, 10], nan_at=2)
    b.submit(reqs[0])
    assert b.collect(0.0) == []  # right after a submit, a batch that is not full waits for more
    for r in reqs[1:]:
        b.submit(r)
    assert b.in_flight() == 6
    first = b.collect(0.0)  # 30 + 40 + 20 fill it (50 more would pass 100 tokens): it runs now
    assert [o.key for o in first] == ["s0", "s1", "s2"]
    assert isinstance(first[2], Failure) and first[2].reason == "nonfinite"
    second = b.collect(0.0)  # 50, then 150 would pass the bound: a full batch of one
    assert [o.key for o in second] == ["s3"]
    third = b.collect(0.0)  # longer than the bound: alone
    assert [o.key for o in third] == ["s4"]
    assert [o.key for o in b.collect(0.0)] == ["s5"]  # not full, but nothing came since the last collect
    assert b.in_flight() == 0
    for o, r in zip(first[:2] + second + third, reqs[:2] + reqs[3:5], strict=True):
        aux, final = ex.extract(r.input_ids)
        assert isinstance(o, States) and same(o.aux, aux) and same(o.final, final)


def test_backend_runs_a_partial_batch_when_asked_to_wait():
    b = InProcessBackend(Extractor(SMALL, device="cpu"), batch_tokens=4096)
    for r in _requests([5, 6, 7]):
        b.submit(r)
    assert b.collect(0.0) == []
    assert [o.key for o in b.collect(0.05)] == ["s0", "s1", "s2"]  # the worker waits: nothing more is coming


def test_backend_capacity_counts_waiting_tokens():
    b = InProcessBackend(Extractor(SMALL, device="cpu"), batch_tokens=4096)
    assert b.capacity == 2 * BATCH_SAMPLES
    for r in _requests([3000, 4000]):
        b.submit(r)
    assert b.capacity == 2 * BATCH_SAMPLES
    b.submit(_requests([1500], seed=6)[0])  # 8500 tokens wait: two batches' worth
    assert b.capacity == b.in_flight() == 3
    b.collect(0.0)  # 3000 (4000 more would pass the bound) runs
    assert b.in_flight() == 2 and b.capacity == 2 * BATCH_SAMPLES


# -- a run ----------------------------------------------------------------------------------------------------

def test_init_flag_and_a_batched_run_store_the_same_states(tmp_path, cli, monkeypatch):
    """`init --batch-tokens` records it; the run's workers get it; every stored sample equals the one a run
    without batching stored (the workers of both runs use the same thread count)."""
    from builder.run.coordinator import RunOptions, run_build
    from builder.run.standby import Standby

    rows = random_rows(24, seed=9, lo=1, hi=90)
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    common = ["--source", src, "--model", SMALL, "--low", "0.997", "--high", "0.998", "--flood", "0.999"]
    cp = cli("init", tmp_path / "one", *common)
    assert cp.returncode == 0, cp.stderr
    cp = cli("init", tmp_path / "packed", *common, "--batch-tokens", "256")
    assert cp.returncode == 0, cp.stderr
    assert BuildConfig.from_toml(layout(tmp_path / "packed").config).batch_tokens == 256
    assert BuildConfig.from_toml(layout(tmp_path / "one").config).batch_tokens is None

    made = []  # the settings each worker of a run is handed (its first message)
    real = Standby.take

    def recording(standby, w, settings):
        made.append(settings.batch_tokens)
        return real(standby, w, settings)

    monkeypatch.setattr(Standby, "take", recording)
    for name in ("one", "packed"):
        assert run_build(tmp_path / name, RunOptions(device="cpu", workers=1)).exit_code == 0  # one worker a run
    assert made == [None, 256]
    one = {item["sample_id"]: item for item in HiddenStateDataset(tmp_path / "one")}
    packed = {item["sample_id"]: item for item in HiddenStateDataset(tmp_path / "packed")}
    assert sorted(one) == sorted(packed) and len(one) == 24
    for sid, item in packed.items():
        for name in ("hidden_state", "aux_hidden_state"):
            assert same_or_irreproducible(item[name], one[sid][name]), f"{sid}: {name}"


def same_or_irreproducible(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal bits; or (two processes' CPU forward passes, see ULP_SLACK in tests/run/test_run.py) at most 0.2% of
    the values off by at most 2 ulps, with a warning. Within one process the tests above demand equal bits."""
    if same(got, ref):
        return True
    a, b = bits(got).numpy().astype(np.int32), bits(ref).numpy().astype(np.int32)
    off = a != b
    ok = bool(((a < 0) == (b < 0))[off].all() and np.abs(a - b)[off].max() <= 2 and off.mean() <= 0.002)
    if ok:
        warnings.warn(f"{int(off.sum())} of {a.size} values differ by <= 2 ulps between two runs' processes",
                      stacklevel=2)
    return ok
