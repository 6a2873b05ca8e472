"""How a run's workers start: forked from the server that imported torch once (the default), or spawned
(HSBUILD_WORKER_START=spawn), both measured in this run, on this machine, alternating.

Two cases:
- `cli`: one `hsbuild run` process a build (a shell, a job script): its workers are its only ones.
- `library`: several builds run one after another in one process (a notebook, a pipeline, the test suite):
  the server started for the first run serves the next.
Each build: `--samples` samples of the small built-in model, `--workers` workers. Time: wall seconds, and the CPU
seconds of the whole machine (`/proc/stat`: the fork server and its children outlive what a parent reaps), so
run it on an otherwise idle machine. Printed as ratios, forked against spawned.

    python tools/bench_start.py                    # 4 samples, 2 workers, 3 rounds, 4 builds a library round
    python tools/bench_start.py --workers 4 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"

LIBRARY = """
import sys
from pathlib import Path
from builder.run.coordinator import RunOptions, run_build
for b in sys.argv[1:]:
    r = run_build(Path(b), RunOptions(progress=False), echo=lambda m: None)
    assert r.exit_code == 0 and r.written > 0, r
"""


def _jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


def _builds(tmp: Path, tag: str, k: int, samples: int, workers: int) -> list[str]:
    from builder.config import BuildConfig, Watermarks  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415

    rng = random.Random(0)
    out = []
    for i in range(k):
        src = tmp / f"{tag}-{i}.jsonl"
        src.write_text("".join(json.dumps({"input_ids": [rng.randrange(1024) for _ in range(rng.randint(16, 96))]})
                               + "\n" for _ in range(samples)))
        root = init_build(tmp / f"{tag}-{i}", src, model=MODEL,
                          watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)).root
        path = layout(root).config
        cfg = BuildConfig.from_toml(path)
        cfg.workers = workers
        cfg.save(path)
        out.append(str(root))
    return out


def _measure(argv: list[str], start: str) -> tuple[float, float]:
    env = {**os.environ, "HSBUILD_WORKER_START": start, "PYTHONPATH": str(ROOT)}
    hz = os.sysconf("SC_CLK_TCK")
    j0, t0 = _jiffies(), time.monotonic()
    cp = subprocess.run(argv, env=env, capture_output=True, text=True)
    if cp.returncode != 0:
        raise SystemExit(f"{argv[:4]} exited {cp.returncode}: {cp.stderr.strip()[-2000:]}")
    wall = time.monotonic() - t0
    time.sleep(0.5)  # the fork server exits once its parent has
    return wall, (_jiffies() - j0) / hz


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--library-builds", type=int, default=4)
    args = ap.parse_args()
    res: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hsbuild-bench-start-") as d:
        tmp = Path(d)
        n = 0
        for r in range(args.rounds):
            for start in (("forkserver", "spawn") if r % 2 == 0 else ("spawn", "forkserver")):
                n += 1
                (b,) = _builds(tmp, f"cli{n}", 1, args.samples, args.workers)
                res.setdefault(("cli", start), []).append(_measure(
                    [sys.executable, "-m", "builder.cli", "run", b, "--no-progress"], start))
                bs = _builds(tmp, f"lib{n}", args.library_builds, args.samples, args.workers)
                res.setdefault(("library", start), []).append(_measure([sys.executable, "-c", LIBRARY, *bs], start))
    print(f"{args.samples} samples a build, {args.workers} workers, {args.rounds} rounds, {os.cpu_count()} cores; "
          f"library: {args.library_builds} builds in one process. Medians:")
    for case in ("cli", "library"):
        fw, fc = (statistics.median(x) for x in zip(*res[(case, "forkserver")], strict=True))
        sw, sc = (statistics.median(x) for x in zip(*res[(case, "spawn")], strict=True))
        print(f"  {case:8s} spawned {sw:6.2f} s, {sc:6.2f} CPU-s | forked {fw:6.2f} s, {fc:6.2f} CPU-s | "
              f"forked/spawned: wall {fw / sw:.2f}, CPU {fc / sc:.2f}")


if __name__ == "__main__":
    main()
