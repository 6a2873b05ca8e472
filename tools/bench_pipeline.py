"""Pipeline benchmark: `hsbuild run` end to end on the built-in model, three ways in the same run, alternating:

- `per-sample`: one barrier (fsync of the sample's files) per sample, committed before the next forward pass
  (HSBUILD_GROUP_SAMPLES=1, HSBUILD_COMMIT_OVERLAP=0): what a torch.save-and-fsync loop pays;
- `grouped`: samples made durable in groups, one barrier each, still committed before extraction goes on
  (HSBUILD_COMMIT_OVERLAP=0);
- `overlap` (the default): groups committed on the worker's committer thread while the next are extracted.

Reports samples/s (median of rounds), each as a ratio to `per-sample`, and the per-sample cost of a barrier
(per-sample minus grouped, over the samples). Each run is a fresh `hsbuild run` subprocess on a fresh build.

    python tools/bench_pipeline.py                       # 96 samples of ~512 tokens, hidden 512
    python tools/bench_pipeline.py --samples 48 --rounds 3 --dir /mnt/ceph/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VARIANTS = {
    "per-sample": {"HSBUILD_GROUP_SAMPLES": "1", "HSBUILD_COMMIT_OVERLAP": "0"},
    "grouped": {"HSBUILD_COMMIT_OVERLAP": "0"},
    "overlap": {},
}


def hsbuild(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cp = subprocess.run([sys.executable, "-m", "builder.cli", *args], capture_output=True, text=True,
                        env={**os.environ, **(env or {})})
    if cp.returncode != 0:
        raise SystemExit(f"hsbuild {' '.join(args)} failed ({cp.returncode}): {cp.stderr.strip()[-400:]}")
    return cp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=512, help="mean tokens a sample")
    ap.add_argument("--model", default="builtin:hidden=512,layers=4,vocab=4096,heads=8,kv_heads=2,intermediate=1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", help="where the builds go (default: a temp dir; put it on the disk to measure)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hsbuild-bench-", dir=args.dir))
    rng = np.random.default_rng(0)
    src = base / "source.jsonl"
    with src.open("w") as f:
        for i in range(args.samples):
            n = int(rng.integers(args.tokens // 2, args.tokens * 3 // 2))
            f.write(json.dumps({"id": f"s{i}", "input_ids": rng.integers(3, 4096, n).tolist(),
                                "loss_mask": [1] * n}) + "\n")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            for name, env in VARIANTS.items():
                build = base / f"{name}-{r}"
                hsbuild("init", str(build), "--source", str(src), "--model", args.model, "--high", "0.99",
                        "--flood", "0.995", "--low", "0.98")
                t0 = time.perf_counter()
                hsbuild("run", str(build), "--no-progress", "--workers", "1", env=env)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(build)
        med = {k: statistics.median(v) for k, v in times.items()}
        base_rate = args.samples / med["per-sample"]
        print(f"{args.samples} samples x ~{args.tokens} tokens, {args.model}, {args.rounds} round(s), in {base}")
        print(f"{'variant':<12} {'run s':>8} {'samples/s':>10} {'ratio':>7}")
        for k, t in med.items():
            rate = args.samples / t
            print(f"{k:<12} {t:8.2f} {rate:10.2f} {rate / base_rate:6.2f}x")
        per = (med["per-sample"] - med["grouped"]) / args.samples
        print(f"a per-sample barrier costs {per * 1e3:.1f} ms a sample here (per-sample minus grouped); "
              f"overlap saves a further {(med['grouped'] - med['overlap']) / args.samples * 1e3:.1f} ms a sample")
        print("run times include process start and model load (the same in every variant)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
