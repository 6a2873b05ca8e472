"""Batched extraction benchmark: samples/s of the in-process backend one sample a forward pass (today's path)
against packed passes (`--batch-tokens`), on the built-in model and a tiny Hugging Face Llama made here (no
download), on the same samples in the same run. Also checks that every batched sample has the one-at-a-time
bits, and (--inexact) measures what packing the matrix products too would give, and how many samples it would
change: that path is not offered, because it is not bit-identical (see builder/extract/model.py, `segments`).

    python tools/bench_batch.py                              # both models, short and demo-like lengths
    python tools/bench_batch.py --models builtin --batch-tokens 512,2048 --samples 64 --threads 2 --inexact
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from builder.extract import model as model_mod
from builder.extract.backends.base import Request, States
from builder.extract.backends.inprocess import InProcessBackend
from builder.extract.model import Block, Extractor, fix_threading


def lengths(kind: str, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    if kind == "short":  # chat turns: 5-120 tokens
        return rng.integers(5, 121, size=n).tolist()
    # `hsbuild demo`'s distribution: lognormal, median about 150 tokens, 4-1500
    return np.clip(rng.lognormal(mean=5.0, sigma=0.7, size=n).astype(int), 4, 1500).tolist()


def tiny_llama(path: Path) -> Path:
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def one_at_a_time(ex: Extractor, samples: list[np.ndarray]) -> list:
    return [ex.extract(ids) for ids in samples]


def batched(ex: Extractor, samples: list[np.ndarray], batch_tokens: int) -> tuple[list, float]:
    """Through the backend, as a worker drives it; returns the states in sample order and the mean batch size."""
    b = InProcessBackend(ex, batch_tokens)
    for i, ids in enumerate(samples):
        b.submit(Request(str(i), ids))
    got: dict[int, States] = {}
    passes = 0
    while b.in_flight():
        outcomes = b.collect(0.05)
        passes += 1
        for o in outcomes:
            assert isinstance(o, States), o
            got[int(o.key)] = (o.aux, o.final)
    return [got[i] for i in range(len(samples))], len(samples) / passes


def _packed_gemm_block(self: Block, x, ropes, spans):
    """NOT bit-identical (the benchmark's --inexact only): projections and MLP over all tokens at once, each
    sample's attention alone."""
    t = x.shape[1]
    h = self.input_layernorm(x)
    q = self.q_proj(h).view(1, t, self.heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(h).view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(h).view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
    rep, outs = self.heads // self.kv_heads, []
    for (a, n), (cos, sin) in zip(spans, ropes, strict=True):
        qi, ki = model_mod._rope(q[:, :, a:a + n], cos, sin), model_mod._rope(k[:, :, a:a + n], cos, sin)
        ki, vi = ki.repeat_interleave(rep, dim=1), v[:, :, a:a + n].repeat_interleave(rep, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
        outs.append(att.transpose(1, 2).reshape(1, n, -1))
    x = x + self.o_proj(torch.cat(outs, dim=1))
    return x + self.mlp(self.post_attention_layernorm(x))


@contextlib.contextmanager
def inexact_packing():
    """Products over all tokens at once: the built-in model's projections and MLPs, a Llama's MLPs."""
    real_block, real_segments = Block.forward_packed, model_mod.segments

    def segments(fn, h, spans):
        return fn(0, h) if isinstance(fn, model_mod._HfMlp) else real_segments(fn, h, spans)

    Block.forward_packed, model_mod.segments = _packed_gemm_block, segments
    try:
        yield
    finally:
        Block.forward_packed, model_mod.segments = real_block, real_segments


def differing(a: list, b: list) -> int:
    def bits(t):
        return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)

    return sum(not (torch.equal(bits(x[0]), bits(y[0])) and torch.equal(bits(x[1]), bits(y[1])))
               for x, y in zip(a, b, strict=True))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench(name: str, ex: Extractor, kind: str, n: int, budgets: list[int], rounds: int, inexact: bool) -> None:
    samples = [np.random.default_rng(i).integers(3, ex.vocab_size, size=k) for i, k in enumerate(lengths(kind, n))]
    tokens = sum(len(s) for s in samples)
    ex.extract(samples[0])  # warm-up (allocator, kernels)
    ex.extract_batch(samples[:4])
    times: dict[str, list[float]] = {}
    ref = None
    sizes: dict[str, float] = {}
    exact: dict[str, int] = {}
    for _ in range(rounds):  # interleaved: a busy machine slows every mode alike
        dt, ref = timed(lambda: one_at_a_time(ex, samples))
        times.setdefault("one at a time", []).append(dt)
        for bt in budgets:
            dt, (got, size) = timed(lambda bt=bt: batched(ex, samples, bt))
            times.setdefault(f"batch {bt}", []).append(dt)
            sizes[f"batch {bt}"], exact[f"batch {bt}"] = size, differing(got, ref)
            if inexact:
                with inexact_packing():
                    dt, (got, size) = timed(lambda bt=bt: batched(ex, samples, bt))
                key = f"batch {bt}, packed products (not offered)"
                times.setdefault(key, []).append(dt)
                sizes[key], exact[key] = size, differing(got, ref)
    base = statistics.median(times["one at a time"])
    print(f"\n{name}: {n} samples ({kind}: {tokens} tokens, median {int(np.median([len(s) for s in samples]))}), "
          f"{torch.get_num_threads()} threads, median of {rounds}")
    print(f"  {'mode':<44}{'samples/s':>10}{'tokens/s':>10}{'ratio':>7}{'batch':>7}  identical")
    for mode, ts in times.items():
        t = statistics.median(ts)
        same = "" if mode not in exact else ("yes" if exact[mode] == 0 else f"NO: {exact[mode]}/{n} differ")
        size = f"{sizes[mode]:.1f}" if mode in sizes else "1"
        print(f"  {mode:<44}{n / t:>10.1f}{tokens / t:>10.0f}{base / t:>7.2f}{size:>7}  {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="builtin,hf", help="builtin, hf (a tiny Llama made here), or a spec/dir")
    ap.add_argument("--lengths", default="short,demo", help="short (5-120 tokens), demo (median ~150, to 1500)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch-tokens", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads (a worker's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--inexact", action="store_true", help="also time packed products (not bit-identical)")
    args = ap.parse_args()
    fix_threading()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.batch_tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models.split(","):
            if m == "hf":
                if importlib.util.find_spec("transformers") is None:
                    print("\nhf: transformers is not installed (the [hf] extra): skipped")
                    continue
                spec, name = str(tiny_llama(Path(tmp) / "llama")), "tiny HF Llama (4 layers, hidden 128)"
            else:
                spec, name = m, m
            ex = Extractor(spec, dtype=args.dtype, device="cpu")
            for kind in args.lengths.split(","):
                bench(name, ex, kind, args.samples, budgets, args.rounds, args.inexact)


if __name__ == "__main__":
    main()
