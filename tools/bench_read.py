"""Read benchmark: random-sample reads through `HiddenStateDataset(BUILD, format="specforge")` against
`torch.load(mmap=True)` of the same samples exported as SpecForge .ckpt files (what SpecForge's offline dataset
reads), in one run. Goal: hsbuild >= 1.0x the baseline.

    python tools/bench_read.py                       # 32 samples x 256..2048 tokens x hidden 1024 x 3 aux layers
    python tools/bench_read.py --codec none --samples 16 --rounds 3
    python tools/bench_read.py --build BUILD         # an existing build (exported once into a temp dir)

It makes a build with the builtin model (`init_build` + `run_build`, as tests/conftest.py does), exports it with
`export_build(..., ExportOptions(format="specforge"))`, then reads the same samples in the same random order (a
fresh permutation each round, shared by every method) with:

- `torch.load(path, mmap=True, weights_only=True)`: the file's dict as loaded, and SpecForge's normalized item
  (specforge's own `normalize_offline_sample` when it is installed, else the builder's `SpecForge.item`; checked
  equal to hsbuild's item before timing);
- `HiddenStateDataset(build, format="specforge")[i]`, with CRC-32C checks (the default) and without them, and
  the plain item (`format=None`).

mmap is lazy, so every method's item is touched the same way: `.sum()` of every tensor in it (every byte read;
bf16 sums run at a few GB/s on one thread, the same cost on both sides). Datasets are made once, outside the
timing, as a training loop would. MB/s are of state bytes (aux + final, bf16; 10^6 bytes); figures are the
median of the rounds. Methods run in a rotated order each round to spread drift on a shared machine.

Warm: every file is read once before the first round, so reads come from the page cache (CPU cost: decode,
checksum, copies, page faults). Cold: before each method's pass the build's data and the export are evicted,
with `posix_fadvise(POSIX_FADV_DONTNEED)` on each file (default: touches only this benchmark's files) or
`--cold drop_caches` (`sync; echo 3 > /proc/sys/vm/drop_caches`, root only, evicts the whole machine's cache);
`fincore` (util-linux), when present, reports what stayed resident after an eviction.

To see where a method's time goes, profile it alone on a kept build, e.g.
    python tools/bench_read.py --keep --cold-rounds 0          # prints the kept dir
    py-spy record -o read.svg -- python tools/bench_read.py --build DIR/build --methods "hsbuild specforge" \\
        --cold-rounds 0 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.config import Watermarks  # noqa: E402
from builder.exchange.export import ExportOptions, export_build  # noqa: E402
from builder.formats.base import Sample  # noqa: E402
from builder.formats.build_info import BuildInfo  # noqa: E402
from builder.formats.specforge import SpecForge  # noqa: E402
from builder.fsutil import dir_size  # noqa: E402
from builder.layout import layout  # noqa: E402
from builder.reader import HiddenStateDataset  # noqa: E402
from builder.run.coordinator import RunOptions, run_build  # noqa: E402
from builder.run.create import init_build  # noqa: E402

MB = 1_000_000
ROOMY = Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)  # a benchmark, not a test of watermarks
BASELINE = "torch.load mmap, file dict"
ITEM = "torch.load mmap, specforge item"


def rows_for(args: argparse.Namespace) -> list[dict]:
    """`args.samples` random source rows of `args.min_tokens`..`args.max_tokens` tokens (seeded by `args.seed`)."""
    rng = np.random.default_rng(args.seed)
    rows = []
    for i in range(args.samples):
        k = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        rows.append({"id": f"s{i:05d}", "input_ids": rng.integers(3, args.vocab, size=k).tolist(),
                     "loss_mask": [0] * (k // 3) + [1] * (k - k // 3)})
    return rows


def make_build(root: Path, args: argparse.Namespace) -> Path:
    """A real build: a JSONL source of random rows, `init_build` with the builtin model, `run_build`."""
    rows = rows_for(args)
    root.parent.mkdir(parents=True, exist_ok=True)
    src = root.parent / "source.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = (f"builtin:hidden={args.hidden},layers={args.layers},vocab={args.vocab},heads={args.heads},"
             f"kv_heads={args.kv_heads},intermediate={args.intermediate}")
    init_build(root, src, model=model, aux_layers=list(range(1, args.aux + 1)), codec=args.codec,
               chunk_tokens=args.chunk_tokens, watermarks=ROOMY, device="cpu")
    report = run_build(root, RunOptions(workers=1), echo=lambda m: None)
    if report.written != args.samples:
        raise SystemExit(f"build: {report.written} of {args.samples} samples written ({report.outcome})")
    return root


def export(build: Path, out: Path, ds: HiddenStateDataset) -> list[Path]:
    """The build as SpecForge .ckpt files; returns them in the dataset's index order (checked by sample id)."""
    export_build(build, out, ExportOptions(format="specforge", allow_overcommit=True, watermarks=ROOMY))
    selection = json.loads((out / "hsbuild-export.json").read_text())["selection"]
    if selection != [e["sample_id"] for e in ds.index]:
        raise SystemExit("export selection and dataset index differ; cannot pair the samples")
    return [out / SpecForge.path_for(i) for i in range(len(selection))]


def touch(item: dict) -> float:
    """Read every byte of every tensor of an item (mmap'd tensors page in here)."""
    return sum(float(v.sum()) for v in item.values() if isinstance(v, torch.Tensor))


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def specforge_normalizer() -> tuple[Callable[[dict], dict], str]:
    """What SpecForge's offline dataset yields for a loaded file: its own `normalize_offline_sample` when
    specforge is installed, else the builder's `SpecForge.item` (the dict hsbuild yields)."""
    try:
        from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: PLC0415
    except ImportError:
        fmt = SpecForge()
        return (lambda d: fmt.item(Sample("", 0, 0, d["input_ids"].long(), d["loss_mask"].long(),
                                          d["aux_hidden_state"][0], d["hidden_state"][0])),
                "builder.formats.specforge.SpecForge.item (specforge is not installed)")
    return (lambda d: normalize_offline_sample(d, max_len=None),
            "specforge.algorithms.eagle3.data.normalize_offline_sample")


def methods(build: Path, files: list[Path], normalize: Callable[[dict], dict]) -> dict[str, Callable[[int], dict]]:
    ds = {"sf": HiddenStateDataset(build, format="specforge"),
          "sf_nocrc": HiddenStateDataset(build, format="specforge", verify_checksums=False),
          "plain": HiddenStateDataset(build)}
    return {BASELINE: lambda i: load_ckpt(files[i]),
            ITEM: lambda i: normalize(load_ckpt(files[i])),
            "hsbuild specforge": ds["sf"].__getitem__,
            "hsbuild specforge, no crc": ds["sf_nocrc"].__getitem__,
            "hsbuild plain item": ds["plain"].__getitem__}


def check_same(get: dict[str, Callable[[int], dict]], n: int) -> None:
    """Both sides give the same SpecForge item (keys, dtypes, shapes, values) for a few samples."""
    for i in sorted({0, n // 2, n - 1}):
        a, b = get[ITEM](i), get["hsbuild specforge"](i)
        if a.keys() != b.keys() or not all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a):
            raise SystemExit(f"sample {i}: the .ckpt's specforge item and hsbuild's differ")


# -- page cache ------------------------------------------------------------------------------------------------


def all_files(*dirs: Path) -> list[Path]:
    return [Path(r) / f for d in dirs for r, _, fs in os.walk(d) for f in fs]


def evict(files: list[Path], how: str) -> None:
    if how == "drop_caches":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # DONTNEED skips dirty pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of these files in the page cache (util-linux `fincore`), None when it cannot tell."""
    if not shutil.which("fincore"):
        return None
    total = 0
    for k in range(0, len(files), 200):
        cp = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                             *map(str, files[k : k + 200])], capture_output=True, text=True)
        if cp.returncode:
            return None
        total += sum(int(x) for x in cp.stdout.split())
    return total


def can_drop_caches() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


# -- timing ----------------------------------------------------------------------------------------------------


def one_pass(get: Callable[[int], dict], order: list[int]) -> float:
    t0 = time.perf_counter()
    for i in order:
        item = get(i)
        touch(item)
        del item  # drop the mmap before the next file
    return time.perf_counter() - t0


def measure(get: dict[str, Callable[[int], dict]], orders: list[list[int]], cold: str | None,
            files: list[Path]) -> tuple[dict[str, list[float]], list[int]]:
    times: dict[str, list[float]] = {name: [] for name in get}
    left: list[int] = []
    names = list(get)
    for r, order in enumerate(orders):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if cold:
                evict(files, cold)
                res = resident_bytes(files) if r == 0 else None
                if res is not None:
                    left.append(res)
            times[name].append(one_pass(get[name], order))
    return times, left


def table(title: str, times: dict[str, list[float]], nbytes: int, n: int) -> None:
    base = statistics.median(times[BASELINE])
    item = statistics.median(times[ITEM]) if ITEM in times else None
    print(f"\n{title}\n")
    print("| method | MB/s | samples/s | vs torch.load dict | vs torch.load item | rounds (s) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, ts in times.items():
        t = statistics.median(ts)
        vs_item = f"{item / t:.2f}x" if item else "-"
        print(f"| {name} | {nbytes / t / MB:,.0f} | {n / t:,.1f} | {base / t:.2f}x | {vs_item} | "
              f"{' '.join(f'{x:.2f}' for x in ts)} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", help="an existing build to read (default: make one in a temp dir)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--aux", type=int, default=3, help="aux layers (hidden_states indices 1..AUX)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the builtin model (>= --aux)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256, help="MLP width (small: the build is faster)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--codec", default="blosc-lz4-bitshuffle:5", help="the build's codec: blosc-lz4-bitshuffle:5 (hsbuild's default), zstd:1, none, ...")
    ap.add_argument("--chunk-tokens", type=int, help="default: what `init` chooses")
    ap.add_argument("--reads", type=int, help="samples read per pass (default: all)")
    ap.add_argument("--rounds", type=int, default=5, help="warm rounds (median reported)")
    ap.add_argument("--cold-rounds", type=int, default=3, help="cold rounds (0: none)")
    ap.add_argument("--cold", choices=("fadvise", "drop_caches"), default="fadvise",
                    help="how to evict before a cold pass (drop_caches: root, whole machine)")
    ap.add_argument("--methods", help="comma-separated substrings: run only the matching methods (the baseline "
                                      "always runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the touch's .sum())")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="where to build and export (default: a temp dir on the current volume)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (reuse the build with --build)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cold == "drop_caches" and args.cold_rounds and not can_drop_caches():
        raise SystemExit("--cold drop_caches: cannot write /proc/sys/vm/drop_caches (needs root); use fadvise")

    base = Path(tempfile.mkdtemp(prefix="hsbuild-bench-read-", dir=args.dir or "."))
    try:
        if args.build:
            build = Path(args.build).absolute()
        else:
            t0 = time.perf_counter()
            build = make_build(base / "build", args)
            print(f"build: {args.samples} samples, {args.min_tokens}..{args.max_tokens} tokens, hidden {args.hidden}, "
                  f"{args.aux} aux layers, codec {args.codec}; made in {time.perf_counter() - t0:.0f}s")
        ds = HiddenStateDataset(build)
        t0 = time.perf_counter()
        files = export(build, base / "export", ds)
        print(f"export: {len(files)} .ckpt files in {time.perf_counter() - t0:.0f}s")
        meta = json.loads((layout(build).data / "zarr.json").read_text())["attributes"]["hsbuild_meta"]
        info = BuildInfo.load(layout(build))
        hidden, n_aux, codec = info.hidden_size, info.n_aux, meta.get("codec", "?")
        n = len(ds) if args.reads is None else min(args.reads, len(ds))
        rng = random.Random(args.seed)
        picked = rng.sample(range(len(ds)), n)
        tokens = sum(int(ds.index[i]["num_tokens"]) for i in picked)
        nbytes = tokens * (n_aux + 1) * hidden * 2
        data_bytes, export_bytes = dir_size(layout(build).data), sum(p.stat().st_size for p in files)
        print(f"reading {n} samples ({tokens} tokens, {nbytes / MB:.0f} MB of bf16 states) in random order; "
              f"codec {codec}, chunk {meta.get('chunk_tokens')} tokens; torch threads {args.threads}")
        print(f"\n| on disk | MB | vs .ckpt |\n|---|---:|---:|\n"
              f"| hsbuild data/ ({codec}) | {data_bytes / MB:,.0f} | {data_bytes / export_bytes:.2f}x |\n"
              f"| specforge .ckpt files | {export_bytes / MB:,.0f} | 1.00x |")

        normalize, normalizer = specforge_normalizer()
        print(f"SpecForge item from a loaded file: {normalizer}")
        get = methods(build, files, normalize)
        if args.methods:
            want = [w.strip() for w in args.methods.split(",") if w.strip()]
            get = {k: v for k, v in get.items() if k == BASELINE or any(w in k for w in want)}
        if ITEM in get and "hsbuild specforge" in get:
            check_same(get, len(ds))

        def orders(k: int) -> list[list[int]]:
            return [rng.sample(picked, n) for _ in range(k)]

        for fn in get.values():  # warm the page cache and every reader (zarr arrays, datasets)
            one_pass(fn, picked)
        warm, _ = measure(get, orders(args.rounds), None, [])
        table(f"warm (page cache), median of {args.rounds} rounds", warm, nbytes, n)
        if args.cold_rounds:
            evicted = all_files(layout(build).data, base / "export")
            cold, left = measure(get, orders(args.cold_rounds), args.cold, evicted)
            how = ("posix_fadvise(DONTNEED) on each file" if args.cold == "fadvise"
                   else "sync; echo 3 > /proc/sys/vm/drop_caches")
            still = (f"; resident after eviction: {max(left) / MB:.1f} MB of "
                     f"{(data_bytes + export_bytes) / MB:.0f} MB (fincore)") if left else ""
            table(f"cold ({how} before each pass{still}), median of {args.cold_rounds} rounds", cold, nbytes, n)
    finally:
        if args.keep:
            print(f"\nkept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
