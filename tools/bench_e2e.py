"""End to end: `hsbuild init` + `hsbuild run` against the loop EAGLE-3 pipelines use today (SpecForge's
prepare_hidden_states style: a transformers forward pass per sample, `torch.save` of one .ckpt a sample), on the
same local transformers Llama, the same samples, the same thread count, each in its own process, one after the
other (two processes each using every core thrash OpenMP), alternating over rounds.

Reported apart:
- start-up: process start, imports, model load (and `hsbuild init`, its own process) until the first sample;
- steady state: first sample started to last sample done (hsbuild: from its event log, first `started` to last
  `written`, i.e. durable; the baseline: its loop, whose files are not fsynced: `os.sync()` after the loop is
  timed apart as "sync");
- bytes on disk (allocated blocks): the baseline's .ckpt files vs the build (segments + event log; the
  build's fixed-size `.ballast` reserve is shown apart).

    python tools/bench_e2e.py                      # 1000 samples of ~256 tokens, a 4-layer hidden-512 Llama
    python tools/bench_e2e.py --workers 1          # hsbuild with one worker of every thread (default: auto)
    python tools/bench_e2e.py --samples 200 --rounds 1 --dir /mnt/ceph/tmp
    python tools/bench_e2e.py --batch-tokens 2048  # hsbuild packs samples into forward passes
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AUX = (1, 2, 3)  # decoder layers whose outputs are the aux states (HF hidden_states[i + 1]); 3, as EAGLE-3 uses


def allocated(path: Path, skip: tuple[str, ...] = ()) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and p.name not in skip:
            total += p.stat().st_blocks * 512
    return total


def make_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                                   torch_dtype="bfloat16")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def baseline_loop(model_dir: str, source: str, out: str, threads: int, t_process: float) -> None:
    """The loop as SpecForge's prepare_hidden_states runs it (one process, one device), timed from inside."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    rows = [json.loads(line) for line in Path(source).read_text().splitlines()]
    t_loaded = time.time()
    with torch.inference_mode():
        for i, row in enumerate(rows):
            ids = torch.tensor([row["input_ids"]], dtype=torch.long)
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[layer + 1] for layer in AUX], dim=-1)
            g = i // 2000 * 2000
            d = Path(out) / f"rows_{g}-{g + 2000}"
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"input_ids": ids[0], "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
                        "hidden_state": hs[-1].clone(), "aux_hidden_state": aux}, d / f"data_{i}.ckpt")
    t_done = time.time()
    os.sync()
    print(json.dumps({"startup": t_loaded - t_process, "steady": t_done - t_loaded,
                      "sync": time.time() - t_done}))


def run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    cp = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if cp.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({cp.returncode}): {cp.stderr.strip()[-600:]}")
    return cp


def hsbuild_once(base: Path, model: Path, source: Path, env: dict, args) -> dict:
    build = base / "build"
    hs = [sys.executable, "-m", "builder.cli"]
    t0 = time.time()
    init = [*hs, "init", str(build), "--source", str(source), "--model", str(model), "--aux-layers",
            ",".join(map(str, AUX)), "--low", "0.98", "--high", "0.99", "--flood", "0.995"]
    if args.batch_tokens:
        init += ["--batch-tokens", str(args.batch_tokens)]
    run(init, env)
    t_init = time.time()
    run([*hs, "run", str(build), "--no-progress", "--workers", str(args.workers)], env)
    t_end = time.time()
    q = ("SELECT epoch(min(ts) FILTER (WHERE kind = 'started')), epoch(max(ts) FILTER (WHERE kind = 'written')), "
         "count(*) FILTER (WHERE kind = 'written') FROM events")
    first, last, n = json.loads(run([*hs, "sql", str(build), q, "--json"], env).stdout)[0].values()
    if n != args.samples:
        raise SystemExit(f"hsbuild wrote {n} of {args.samples} samples")
    ballast = sum(p.stat().st_blocks * 512 for p in build.rglob(".ballast"))
    res = {"startup": (t_init - t0) + (first - t_init), "init": t_init - t0, "steady": last - first,
           "sync": 0.0, "total": t_end - t0, "bytes": allocated(build, skip=(".ballast",)), "ballast": ballast}
    shutil.rmtree(build)
    return res


def baseline_once(base: Path, model: Path, source: Path, env: dict, args) -> dict:
    out = base / "ckpt"
    t0 = time.time()
    cp = run([sys.executable, __file__, "--baseline-loop", str(model), str(source), str(out), str(args.threads),
              repr(t0)], env)
    res = json.loads(cp.stdout.strip().splitlines()[-1])
    res["total"] = time.time() - t0
    res["bytes"] = allocated(out)
    shutil.rmtree(out)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline-loop":
        model_dir, source, out, threads, t_process = sys.argv[2:7]
        baseline_loop(model_dir, source, out, int(threads), float(t_process))
        return
    import numpy as np  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=256, help="mean tokens a sample (uniform, 1/2x to 3/2x)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", default="auto",
                    help="hsbuild --workers: a number (the threads split among them) or auto (hsbuild's default)")
    ap.add_argument("--batch-tokens", type=int, default=0, help="hsbuild: pack samples into passes (0: off)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads, both sides")
    ap.add_argument("--dir", help="where the outputs go (default: a temp dir; put it on the disk to measure)")
    args = ap.parse_args()
    # hsbuild's modules compiled to bytecode first, as `pip install` leaves them: where PYTHONDONTWRITEBYTECODE is
    # set, each of its processes (init, the coordinator, every worker) would compile them again (about 0.07 s each)
    compileall.compile_dir(ROOT / "builder", quiet=1)
    base = Path(tempfile.mkdtemp(prefix="hsbuild-e2e-", dir=args.dir))
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    try:
        model = base / "llama"
        make_model(model, args.hidden, args.layers, args.vocab)
        rng = np.random.default_rng(0)
        source = base / "source.jsonl"
        with source.open("w") as f:
            for i in range(args.samples):
                n = int(rng.integers(args.tokens // 2, args.tokens * 3 // 2))
                mask = [0] * (n // 3) + [1] * (n - n // 3)
                f.write(json.dumps({"id": f"s{i}", "input_ids": rng.integers(3, args.vocab, n).tolist(),
                                    "loss_mask": mask}) + "\n")
        results: dict[str, list[dict]] = {"baseline": [], "hsbuild": []}
        for _ in range(args.rounds):
            results["baseline"].append(baseline_once(base, model, source, env, args))
            results["hsbuild"].append(hsbuild_once(base, model, source, env, args))
        med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in results.items()}
        b, h = med["baseline"], med["hsbuild"]
        print(f"{args.samples} samples x ~{args.tokens} tokens, Llama hidden {args.hidden} x {args.layers} layers, "
              f"{args.threads} threads, hsbuild --workers {args.workers}"
              + (f" --batch-tokens {args.batch_tokens}" if args.batch_tokens else "")
              + f", median of {args.rounds} round(s), in {base}")
        print(f"{'':<10} {'start-up s':>10} {'steady s':>9} {'sync s':>7} {'total s':>8} {'samples/s':>10} "
              f"{'MB on disk':>11}")
        for side, m in med.items():
            print(f"{side:<10} {m['startup']:10.2f} {m['steady']:9.2f} {m['sync']:7.2f} {m['total']:8.2f} "
                  f"{args.samples / m['steady']:10.1f} {m['bytes'] / 1e6:11.1f}")
        print(f"hsbuild / baseline: steady-state speed {b['steady'] / h['steady']:.2f}x, end to end "
              f"{b['total'] / h['total']:.2f}x faster, bytes on disk {h['bytes'] / b['bytes']:.2f}x "
              f"(+ the build's reserve .ballast, {h['ballast'] / 1e6:.1f} MB, not counted); hsbuild's steady state "
              "is durable (fsynced), the baseline's is not until its sync")
        print(f"hsbuild's start-up: `hsbuild init` {h['init']:.2f} s (its own process: source, tokenizer, model "
              f"digest), `hsbuild run` until the first sample started {h['startup'] - h['init']:.2f} s")
        # each round's pair (run one after the other): the spread says how far a median can be trusted here
        pairs = list(zip(results["baseline"], results["hsbuild"], strict=True))
        print("per round, end to end: " + ", ".join(f"{bl['total'] / hs['total']:.2f}x" for bl, hs in pairs)
              + f" (median {statistics.median(bl['total'] / hs['total'] for bl, hs in pairs):.2f}x); steady: "
              + ", ".join(f"{bl['steady'] / hs['steady']:.2f}x" for bl, hs in pairs))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
