"""Batched generation in-process (a regenerating build run with --batch-tokens; builder/extract/generation_batch.py):
requests decoded together get exactly what each gets generated alone, bit for bit: the tokens (greedy, sampled,
stopped, cut at the limit), the finish reason, the states of every stored token, and each one's own error; the
greedy tokens equal transformers' `generate`. In float32 this machine's CPU kernels give a row among others other
bits than alone (a one-row product, SiLU's scalar tail), which the batched step must detect and work around: the
model's widths here (intermediate 172) have such tails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.errors import SampleError
from builder.extract.backends.base import Generation
from builder.extract.model import Extractor

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

LIMIT = 128
STOPS = (5, 17, 101, 159, 242, 369)  # some of the responses below stop at one of them (checked)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LIMIT)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("batch-model") / "m"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _requests() -> list[tuple[np.ndarray, Generation]]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(10):
        prompt = rng.integers(3, 512, int(rng.integers(3, 60)))
        out.append((prompt, Generation(max_new_tokens=int(rng.integers(1, 24)), temperature=0.0 if i % 3 else 0.9,
                                       top_p=0.8 if i % 2 else 1.0, seed=i, stop_ids=STOPS,
                                       capture=i != 4)))
    out.append((rng.integers(3, 512, LIMIT), Generation(max_new_tokens=4, stop_ids=STOPS)))  # no room: too_long, alone
    out.append((rng.integers(3, 512, LIMIT - 2), Generation(max_new_tokens=9, stop_ids=STOPS)))  # cut at the context
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("final_state", ["post_norm", "pre_norm"])
def test_batched_generation_equals_each_alone(llama, dtype, final_state):
    ex = Extractor(str(llama), None, dtype, "cpu", final_state=final_state)
    reqs = _requests()
    alone = []
    for ids, gen in reqs:
        try:
            alone.append(ex.generate(ids, gen, LIMIT))
        except SampleError as e:
            alone.append(e)
    together = ex.generate_batch(reqs, LIMIT)
    assert len(together) == len(reqs)
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        if isinstance(a, SampleError):
            assert isinstance(b, SampleError) and (b.reason, str(b)) == (a.reason, str(a)), i
            continue
        assert b.output_ids.tolist() == a.output_ids.tolist() and b.finish_reason == a.finish_reason, i
        if a.aux is None:
            assert b.aux is None and b.final is None, i
            continue
        assert torch.equal(b.aux, a.aux) and torch.equal(b.final, a.final), i
    reasons = {a.finish_reason for a in alone if not isinstance(a, SampleError)}
    assert reasons == {"stop", "length"}  # (the requests hold both kinds)
    # the greedy ones are transformers' greedy generate
    model = ex._model
    for (ids, gen), b in zip(reqs, together, strict=True):
        if gen.temperature or isinstance(b, SampleError):
            continue
        room = min(gen.max_new_tokens, LIMIT - len(ids))
        want = model.generate(torch.tensor([ids.tolist()]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=room, do_sample=False, eos_token_id=list(gen.stop_ids),
                              pad_token_id=gen.stop_ids[0])[0, len(ids):].tolist()
        assert b.output_ids.tolist() == want


def test_backend_decodes_generation_requests_together(llama):
    """--batch-tokens: the in-process backend hands the pending generation requests to one batched generation
    (all their outcomes from one `collect`), a plain request after them in a pass of its own; each gets the
    tokens its lone generation gives."""
    from builder.extract.backends.base import Request, States
    from builder.extract.backends.inprocess import InProcessBackend

    ex = Extractor(str(llama), None, "bfloat16", "cpu")
    reqs = _requests()[:4]
    for batch_tokens, per_collect in ((4096, [4, 1]), (None, [5])):
        be = InProcessBackend(ex, batch_tokens)
        for i, (ids, gen) in enumerate(reqs):
            be.submit(Request(f"g{i}", ids, generate=gen))
        be.submit(Request("plain", reqs[0][0]))
        got = [be.collect(1.0) for _ in per_collect]
        assert [len(o) for o in got] == per_collect and be.in_flight() == 0
        outcomes = {o.key: o for batch in got for o in batch}
        assert all(isinstance(o, States) for o in outcomes.values())
        for i, (ids, gen) in enumerate(reqs):
            alone = ex.generate(ids, gen, LIMIT)
            assert outcomes[f"g{i}"].output_ids.tolist() == alone.output_ids.tolist()
        assert outcomes["plain"].output_ids is None


def test_a_batched_step_that_raises_gives_each_request_its_lone_outcome(llama, monkeypatch):
    """A batched decode step that raises (on a GPU: out of memory, where each request alone fits; raised here by
    hand, this machine has no GPU memory to exhaust) fails no request: each is generated alone, with its own
    tokens (the same seeds, so what it would have got batched) or its own error (it failed them all before)."""
    from builder.extract import generation_batch
    from builder.extract.backends.base import Failure, Request, States
    from builder.extract.backends.inprocess import InProcessBackend

    ex = Extractor(str(llama), None, "bfloat16", "cpu")
    reqs = _requests()[:4] + _requests()[-2:-1]  # (the last one: too_long, its own error)

    def oom(*_a, **_k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(generation_batch._HfBatchStep, "__call__", oom)
    be = InProcessBackend(ex, 4096)
    for i, (ids, gen) in enumerate(reqs):
        be.submit(Request(f"g{i}", ids, generate=gen))
    outcomes = {o.key: o for o in be.collect(1.0)}
    assert len(outcomes) == len(reqs) and be.in_flight() == 0
    for i, (ids, gen) in enumerate(reqs[:-1]):
        alone = ex.generate(ids, gen, LIMIT)
        assert isinstance(outcomes[f"g{i}"], States), outcomes[f"g{i}"]
        assert outcomes[f"g{i}"].output_ids.tolist() == alone.output_ids.tolist()
    last = outcomes[f"g{len(reqs) - 1}"]
    assert isinstance(last, Failure) and last.reason == "too_long", last
