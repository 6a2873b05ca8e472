"""Regeneration benchmark (issue 43), in-process: regenerate + capture in one pass against the two-pass pipeline
the trainers' scripts run (generate, then a separate prefill over prompt + response to capture the states), on the
same Hugging Face Llama (random weights, built here with transformers: nothing is downloaded), the same prompts
and settings (greedy, the same max_new_tokens), in one run, alternating, on this machine's CPU (or --device).

- `one-pass`: `Extractor.generate_batch` with capture (hsbuild's path: the prompt's states from the prefill, each
  generated token's from its decode step, the last token's from one more one-token step);
- `two-pass`: `Extractor.generate_batch` without capture (the same decode loop, keeping nothing), then
  `Extractor.extract_batch` over each prompt and its generated tokens (hsbuild's own prefill extraction).

`--batch N` decodes N prompts' generations together in both variants (what `run --batch-tokens` does; 1: each
alone, as a run without it); the same batching for both, so the ratio compares one pass with two passes, not
batched with unbatched. Batching pays where the kernels give each row of a product the bits it gets alone
(bfloat16 with AMX; builder/extract/generation_batch.py), else the products run row by row. It also reports the
two-pass pipeline's parts: the generation, and the second prefill per token.

Both give the same tokens (checked); it reports each variant's wall and CPU seconds (median of --rounds) and
the ratios two-pass / one-pass: wall time, of the medians and round by round (the two variants of a round run
back to back), and CPU time (this process's, all its threads): on a machine shared with other work, wall times
swing with the others' load, CPU time much less (use --threads 1 there: idle threads spinning count as CPU). The saving is the second prefill: the longer the prompt against the response, the more.

    python tools/bench_regen.py                                   # hidden 1024, 8 layers, prompts 512, new 128
    python tools/bench_regen.py --prompt-tokens 256 --new-tokens 256 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_model(directory: Path, hidden: int, layers: int, vocab: int, positions: int) -> Path:
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 256), max_position_embeddings=positions)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(directory)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="generations decoded together, both variants (1: alone)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from builder.extract.backends.base import Generation  # noqa: PLC0415
    from builder.extract.model import Extractor  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        d = build_model(Path(tmp) / "llama", args.hidden, args.layers, args.vocab,
                        args.prompt_tokens + args.new_tokens + 8)
        ex = Extractor(str(d), None, args.dtype, args.device, final_state="post_norm")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, args.vocab, args.prompt_tokens) for _ in range(args.prompts)]
        limit = ex.max_positions
        # no stop id: every response is new-tokens long, so both variants do the same work
        gen = Generation(max_new_tokens=args.new_tokens)
        bare = Generation(max_new_tokens=args.new_tokens, capture=False)

        groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        parts: dict[str, list[float]] = {"generate": [], "prefill": []}

        def one_pass() -> list[np.ndarray]:
            return [g.output_ids for group in groups for g in ex.generate_batch([(p, gen) for p in group], limit)]

        def two_pass() -> list[np.ndarray]:
            out, t_gen, t_pre = [], 0.0, 0.0
            for group in groups:
                c0 = time.process_time()
                made = ex.generate_batch([(p, bare) for p in group], limit)
                c1 = time.process_time()
                ex.extract_batch([np.concatenate([p, g.output_ids]) for p, g in zip(group, made, strict=True)])
                t_gen, t_pre = t_gen + c1 - c0, t_pre + time.process_time() - c1
                out.extend(g.output_ids for g in made)
            parts["generate"].append(t_gen)
            parts["prefill"].append(t_pre)
            return out

        one_pass()  # warm-up (allocator, kernels)
        times: dict[str, list[float]] = {"one-pass": [], "two-pass": []}
        cpu: dict[str, list[float]] = {"one-pass": [], "two-pass": []}
        tokens: dict[str, list[np.ndarray]] = {}
        for _ in range(args.rounds):
            for name, fn in (("one-pass", one_pass), ("two-pass", two_pass)):
                t0, c0 = time.perf_counter(), time.process_time()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        same = all(np.array_equal(a, b) for a, b in zip(tokens["one-pass"], tokens["two-pass"], strict=True))
        one, two = statistics.median(times["one-pass"]), statistics.median(times["two-pass"])
        ratios = [b / a for a, b in zip(times["one-pass"], times["two-pass"], strict=True)]
        print(f"model: HF Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({args.dtype}, random "
              "weights); "
              f"device {ex.device}, {torch.get_num_threads()} threads")
        print(f"work: {args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each, "
              f"greedy, {args.batch} decoded together; {args.rounds} rounds; same tokens both ways: {same}")
        for name, ts in times.items():
            print(f"{name}: wall median {statistics.median(ts):.2f} s ({', '.join(f'{t:.2f}' for t in ts)}); CPU "
                  f"median {statistics.median(cpu[name]):.2f} s ({', '.join(f'{t:.2f}' for t in cpu[name])})")
        g, p = statistics.median(parts["generate"]), statistics.median(parts["prefill"])
        steps = args.prompts * args.new_tokens
        print(f"two-pass parts, CPU: generate {g:.2f} s ({1000 * g / steps:.2f} ms per generated token, prefills "
              f"included), second prefill {p:.2f} s ({1000 * p / (args.prompts * (args.prompt_tokens + args.new_tokens)):.3f} "
              "ms per token)")
        c1, c2 = statistics.median(cpu["one-pass"]), statistics.median(cpu["two-pass"])
        print(f"two-pass / one-pass, CPU time: {c2 / c1:.2f}x (medians)")
        print(f"two-pass / one-pass: {two / one:.2f}x (medians); per round {', '.join(f'{r:.2f}' for r in ratios)}, "
              f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
