"""Codec benchmark on real builds: the same source extracted by the same model once per codec, then each build's
bytes on disk and its warm read speed (every sample through `HiddenStateDataset`, checksums on; read rounds
interleaved over the builds), as ratios against the `none` build measured in the same run. Figures in the README come from this script.

    python tools/bench_codecs.py                                   # builtin model, 100 demo samples
    python tools/bench_codecs.py --samples 40 --codecs none,zstd:1,blosc-lz4:5
    python tools/bench_codecs.py --codecs none,blosc-lz4-bitshuffle:5,fp8:none,fp8:blosc-lz4-bitshuffle:5

`fp8:CODEC` is a build made with `init --quantize fp8 --codec CODEC` (lossy): its column `fp8 err` is the median
and the largest relative RMS error of the aux states over its samples, as their `written` events record them.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from builder.config import Watermarks
from builder.extract.demo import write_demo_source
from builder.fsutil import dir_size
from builder.layout import layout
from builder.log.query import run_query
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

ROOMY = Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)


def read_all(build: Path) -> tuple[float, int]:
    """Seconds to read every sample once (warm), and the uncompressed bytes read."""
    ds = HiddenStateDataset(build)
    t0 = time.perf_counter()
    nbytes = 0
    for i in range(len(ds)):
        item = ds[i]
        nbytes += sum(v.numel() * v.element_size() for k, v in item.items() if hasattr(v, "numel"))
    return time.perf_counter() - t0, nbytes


def fp8_errors(build: Path) -> str:
    """Median and largest recorded aux-state error of an fp8 build ('' for an exact one)."""
    _, rows = run_query(layout(build), "SELECT median(e), max(e) FROM (SELECT CAST(json_extract(detail, "
                                       "'$.fp8_error.aux_hidden_state') AS DOUBLE) AS e FROM events "
                                       "WHERE kind = 'written') WHERE e IS NOT NULL")
    med, top = rows[0]
    return "" if med is None else f"{med:.2e}/{top:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100, help="demo samples (varied lengths, 4-1500 tokens)")
    ap.add_argument("--model", default="builtin", help="builtin (hidden 256, 8 layers), builtin:..., or a Hugging Face model directory")
    ap.add_argument("--codecs", default="none,blosc-lz4-bitshuffle:5,zstd:1,zstd:3,blosc-lz4:5,blosc-zstd-bitshuffle:3",
                    help="comma-separated; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=5, help="warm read rounds (median reported)")
    ap.add_argument("--dir", help="where to build (default: a temp dir on the current volume)")
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    work = Path(tempfile.mkdtemp(prefix="hsbuild-codecs-", dir=args.dir or "."))
    try:
        src = write_demo_source(work / "source.jsonl", n=args.samples)
        rows = []
        for codec in codecs:
            root = work / codec.replace(":", "-")
            fp8 = codec.startswith("fp8:")
            init_build(root, src, model=args.model, codec=codec.removeprefix("fp8:"), watermarks=ROOMY,
                       quantize="fp8" if fp8 else "none")
            t0 = time.perf_counter()
            rep = run_build(root, RunOptions(workers=1), echo=lambda _m: None)
            build_s = time.perf_counter() - t0
            assert rep.written == args.samples, rep
            read_all(root)  # warm the page cache
            rows.append([codec, dir_size(root / "data"), [], 0, build_s, root, fp8_errors(root)])
            print(f"{codec}: built", flush=True)
        for _ in range(args.rounds):  # rounds interleaved over the codecs: a busy machine slows all alike
            for row in rows:
                dt, row[3] = read_all(row[5])
                row[2].append(dt)
        rows = [(codec, disk, statistics.median(times), nbytes, build_s, err)
                for codec, disk, times, nbytes, build_s, _root, err in rows]
        base_bytes, base_read = rows[0][1], rows[0][2]
        print(f"\n{args.samples} samples, model {args.model}; baseline {codecs[0]} ({rows[0][1] / 1e6:.1f} MB on disk, "
              f"read {rows[0][3] / rows[0][2] / 1e6:.0f} MB/s)")
        width = max(14, *(len(c) + 2 for c in codecs))
        print(f"{'codec':<{width}}{'on disk':>10}{'size vs ' + codecs[0]:>14}{'read MB/s':>11}"
              f"{'read speed vs ' + codecs[0]:>22}{'build s':>9}  fp8 err (median/max)")
        for codec, disk, read_s, nbytes, build_s, err in rows:
            print(f"{codec:<{width}}{disk / 1e6:>8.1f}MB{disk / base_bytes:>13.2f}x{nbytes / read_s / 1e6:>11.0f}"
                  f"{base_read / read_s:>21.2f}x{build_s:>9.1f}  {err}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
