"""Export throughput: `hsbuild export` (file per sample) against plain loops writing the same files, in the same run.

    python tools/bench_export.py                            # 20,000 tiny samples (8-32 tokens, hidden 64), specforge
    python tools/bench_export.py --samples 2000 --format modelopt,speculators
    python tools/bench_export.py --seed-shape               # also 6 samples of 2,200 tokens x hidden 7168 (4 states)

The build is synthetic (tools/bench_verify.py's: bf16 states written by SegmentWriter in groups, `written`
events, no model), the export is `export_build` in this process (what `hsbuild export` runs: reading through the
checksums, the format's bytes, the watermarks, the journal). Baselines, over the same files, one file after
another, each file fsynced:
- torch.save: each exported file loaded back (not timed), then saved again with `torch.save` to a temp name,
  fsynced, renamed (what a home-grown export loop does; speculators' files with safetensors' `save_file`);
- raw: the exported files' bytes written again (create, write, fsync, close): the filesystem's own rate for
  files of this size, one writer; and the same with the export's writer threads (`export_writers.THREADS`);
- at the seed's shape, MB/s against the same bytes written by `np.ndarray.tofile` + fsync.
The page cache holds the build (read once before timing); files/s and MB/s (10^6 bytes) are of sample files.
With --repeat N the export and the loops run N times, interleaved; each row is its median, with the range of the
export's ratio to it, and the export's CPU a file (this process, all its threads: a figure the machine's other
load changes less than a rate) and the load average are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

MB = 1_000_000


def set_final_state(build: Path, state: str) -> None:
    """What the synthetic states stand for: speculators takes the state before the norm, the others after it."""
    path = build / "data" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["attributes"]["hsbuild_meta"]["final_state"] = state
    path.write_text(json.dumps(doc))


def make(root: Path, samples: int, tokens: tuple[int, int], hidden: int) -> Path:
    """tools/bench_verify.py's synthetic build, with what an export asks of its metadata (layers, vocabulary)."""
    import bench_verify  # noqa: PLC0415

    bench_verify.make_build(root, samples, tokens, hidden, 4, 128, "blosc-lz4-bitshuffle:5", 64)
    path = root / "data" / "zarr.json"
    doc = json.loads(path.read_text())
    attrs = doc["attributes"]
    attrs["hsbuild_meta"] = {**{k: v for k, v in attrs.items() if k != "hsbuild_layout"}, "num_layers": 4,
                             "vocab_size": 32000, "final_state": "post_norm"}
    path.write_text(json.dumps(doc))
    return root


def sample_files(out: Path, fmt: str) -> list[Path]:
    from builder.formats import make_format  # noqa: PLC0415

    return make_format(fmt).scan(out)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_export(build: Path, out: Path, fmt: str) -> float:
    from builder.config import Watermarks  # noqa: PLC0415
    from builder.exchange.export import ExportOptions, export_build  # noqa: PLC0415

    roomy = Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)
    t = time.perf_counter()
    rep = export_build(build, out, ExportOptions(format=fmt, allow_overcommit=True, watermarks=roomy))
    took = time.perf_counter() - t
    assert rep.complete and rep.exported == rep.rows, rep
    return took


def save_loop(files: list[Path], src: Path, dst: Path, fmt: str) -> float:
    """Each file's contents saved again by its library, to a temp name, fsynced, renamed; the folders fsynced."""
    import torch  # noqa: PLC0415

    if fmt == "speculators":
        from safetensors.torch import load_file, save_file  # noqa: PLC0415

        loaded = [load_file(str(p)) for p in files]

        def save(obj: object, path: Path) -> None:
            save_file(obj, str(path))  # type: ignore[arg-type]
    else:
        loaded = [torch.load(p, weights_only=True) for p in files]

        def save(obj: object, path: Path) -> None:
            torch.save(obj, path)
    rels = [p.relative_to(src) for p in files]
    for d in {r.parent for r in rels}:
        (dst / d).mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for obj, rel in zip(loaded, rels, strict=True):
        tmp = dst / rel.with_name(rel.name + ".tmp")
        save(obj, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, dst / rel)
    for d in {r.parent for r in rels}:
        fsync_dir(dst / d)
    return time.perf_counter() - t


def raw_loop(files: list[Path], src: Path, dst: Path, threads: int = 1) -> float:
    """The same bytes: create, write, fsync, close, one file after another (or on `threads` threads)."""
    blobs = [(p.relative_to(src), p.read_bytes()) for p in files]
    for d in {r.parent for r, _ in blobs}:
        (dst / d).mkdir(parents=True, exist_ok=True)

    def one(item: tuple[Path, bytes]) -> None:
        fd = os.open(dst / item[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, item[1])
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, blobs))
    else:
        for item in blobs:
            one(item)
    for d in {r.parent for r, _ in blobs}:
        fsync_dir(dst / d)
    return time.perf_counter() - t


def tofile_loop(files: list[Path], dst: Path) -> float:
    """At the seed's shape: the same number of bytes a file, written by numpy's tofile and fsynced."""
    import numpy as np  # noqa: PLC0415

    arrays = [np.frombuffer(p.read_bytes(), np.uint8) for p in files]
    dst.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for i, a in enumerate(arrays):
        with open(dst / f"{i}.bin", "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(dst)
    return time.perf_counter() - t


def measure(build: Path, work: Path, fmt: str, seed_shape: bool, repeat: int) -> list[str]:
    """The export and each loop `repeat` times, interleaved (export, loops, export, loops...): per row its median
    rate and the range of the export's ratio to it over the repeats, with the export's CPU a file (this process's,
    every thread) and the load average, since the machine may be shared."""
    try:
        from builder.exchange.export_writers import THREADS  # noqa: PLC0415
    except ImportError:  # (an hsbuild before it: measured against the same baselines)
        THREADS = 8  # noqa: N806

    out = work / f"out-{fmt}"
    set_final_state(build, "pre_norm" if fmt == "speculators" else "post_norm")
    loops = [("torch.save loop" if fmt != "speculators" else "safetensors loop", lambda f, d: save_loop(f, out, d, fmt)),
             ("raw create+write+fsync, 1 writer", lambda f, d: raw_loop(f, out, d)),
             (f"raw create+write+fsync, {THREADS} writers", lambda f, d: raw_loop(f, out, d, THREADS)),
             *((("np.tofile + fsync", lambda f, d: tofile_loop(f, d)),) if seed_shape else ())]
    took: dict[str, list[float]] = {"hsbuild export": []}
    cpu, loads = [], []
    n = size = 0
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        c = time.process_time()
        took["hsbuild export"].append(timed_export(build, out, fmt))
        files = sample_files(out, fmt)
        n, size = len(files), sum(p.stat().st_size for p in files)
        cpu.append((time.process_time() - c) / n)
        loads.append(os.getloadavg()[0])
        for name, fn in loops:
            dst = work / "plain"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            took.setdefault(name, []).append(fn(files, dst))
            shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    lines = [f"{fmt}: {n:,} files, {size / n / 1e3:,.1f} kB a file; export CPU {_span([c * 1e3 for c in cpu], 3)} ms "
             f"a file; load average {_span(loads, 1)} (2 cores here); {repeat} repeat(s), medians"]
    mine = took["hsbuild export"]
    for name, secs in took.items():
        med = statistics.median(secs)
        ratios = [t / e for t, e in zip(secs, mine, strict=True)]
        lines.append(f"  {name:<36} {n / med:>9,.0f} files/s {size / med / MB:>9,.1f} MB/s   "
                     f"export/this {_span(ratios, 2)}x")
    return lines


def _span(xs: list[float], digits: int) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20_000, help="tiny samples (8-32 tokens, hidden 64, 4 states)")
    ap.add_argument("--format", default="specforge", help="comma-separated file-per-sample formats")
    ap.add_argument("--seed-shape", action="store_true", help="also 6 samples of 2,200 tokens x hidden 7168")
    ap.add_argument("--seed-samples", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=1, help="the export and the loops this many times, interleaved")
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one, removed afterwards)")
    a = ap.parse_args(argv)
    work = a.dir or Path(tempfile.mkdtemp(prefix="hsbuild-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        shapes = [("tiny", a.samples, (8, 32), 64)] if a.samples else []
        if a.seed_shape:
            shapes.append(("seed", a.seed_samples, (2200, 2200), 7168))
        for label, samples, tokens, hidden in shapes:
            t = time.perf_counter()
            build = make(work / f"build-{label}", samples, tokens, hidden)
            print(f"\nbuild: {samples:,} samples x {tokens[0]}-{tokens[1]} tokens x hidden {hidden} x 4 states (bf16), "
                  f"made in {time.perf_counter() - t:.1f} s", flush=True)
            for fmt in a.format.split(","):
                for line in measure(build, work, fmt, label == "seed", a.repeat):
                    print(line, flush=True)
            shutil.rmtree(build, ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
