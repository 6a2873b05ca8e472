"""Verify throughput: `hsbuild verify` (Zarr read-back + crc32c, threads) against a plain loop over the same chunk
files (read, decompress with numcodecs, crc32c), on a synthetic build of bf16 states.

    python tools/bench_verify.py                       # 8 samples x 2048 tokens x hidden 4096 x 4 states
    python tools/bench_verify.py --samples 4 --tokens 512 --hidden 1024 --jobs 1,2,4

Both sides read from the page cache (the build is read once before timing), so the figures compare CPU cost:
decode, copy and checksum. MB/s are of uncompressed bytes checked (10^6 bytes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import crc32c
import numpy as np
import torch
from numcodecs import Blosc, Zstd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.config import BuildConfig, Watermarks  # noqa: E402
from builder.extract.source import Sample, fingerprint  # noqa: E402
from builder.layout import layout  # noqa: E402
from builder.log.events import Event, EventLog, detail  # noqa: E402
from builder.store.segment import (  # noqa: E402
    FIELDS,
    SegmentWriter,
    field_geometry,
    init_data_group,
    new_segment_name,
    sample_files,
)
from builder.store.shard import read_index  # noqa: E402
from builder.verify.sweep import SweepOptions, run_sweep  # noqa: E402

MB = 1_000_000


def make_build(root: Path, samples: int, tokens: int, hidden: int, states: int, chunk_tokens: int,
               codec: str) -> Path:
    """A build whose samples were written by SegmentWriter and recorded with `written` events, no model."""
    lay = layout(root)
    root.mkdir(parents=True)
    n_aux = states - 1
    rng = np.random.default_rng(0)
    src = root / "source.jsonl"
    rows = [rng.integers(3, 32000, tokens).astype(np.int32) for _ in range(samples)]
    src.write_text("".join(json.dumps({"id": f"b{i:04d}", "input_ids": r.tolist()}) + "\n" for i, r in enumerate(rows)))
    cfg = BuildConfig(source=str(src), model="synthetic", aux_layers=list(range(1, states)), codec=codec,
                      chunk_tokens=chunk_tokens, watermarks=Watermarks(0.997, 0.998, 0.999))
    meta = {"model": "synthetic", "aux_layers": cfg.aux_layers, "hidden_size": hidden, "dtype": "bfloat16",
            "storage_dtype": "uint16", "chunk_tokens": chunk_tokens, "codec": codec}
    init_data_group(lay.data, meta)
    writer = SegmentWriter(lay.data, new_segment_name("bench0000", 0), hidden, n_aux, chunk_tokens, codec).create()
    with EventLog(lay.events) as log:
        log.set_meta(meta)
        mask = np.ones(tokens, np.uint8)
        log.register_samples([Sample(f"b{i:04d}", i, r, mask, fingerprint(r, mask)) for i, r in enumerate(rows)])
        gen = torch.Generator().manual_seed(0)
        for i, ids in enumerate(rows):
            aux = torch.randn(tokens, n_aux * hidden, generator=gen).to(torch.bfloat16)
            final = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
            loc = writer.write(ids, mask, aux, final)
            log.append([Event("written", run_id="bench", sample_id=f"b{i:04d}", fingerprint=fingerprint(ids, mask),
                              attempt=1, worker=0, segment=loc.segment, token_start=loc.token_start,
                              num_tokens=loc.num_tokens, nbytes=loc.nbytes,
                              checksums=json.dumps(loc.checksums, sort_keys=True), detail=detail(bench=True))])
    writer.seal()
    cfg.save(lay.config)
    return root


def _decoder(codec: str):
    name, _, level = codec.partition(":")
    if name == "zstd":
        return Zstd(level=int(level or 1)).decode
    if name.startswith("blosc"):
        return Blosc().decode
    return bytes


def plain_loop(root: Path, codec: str) -> tuple[int, float, bool]:
    """Read every written sample's chunk files, decompress, crc32c the sample's bytes of each field, compare."""
    lay = layout(root)
    with EventLog(lay.events, read_only=True) as log:
        rows = log.query_dicts("SELECT segment, token_start, num_tokens, checksums FROM samples "
                               "WHERE state IN ('written', 'verified') ORDER BY segment, token_start")
    decode = _decoder(codec)
    widths = {f: json.loads((lay.data / rows[0]["segment"] / f / "zarr.json").read_text()) for f in FIELDS}
    row_bytes = {f: int(np.prod(w["chunk_grid"]["configuration"]["chunk_shape"][1:] or [1]))
                 * {"int32": 4, "uint8": 1, "uint16": 2}[w["data_type"]] for f, w in widths.items()}
    raw, all_match = 0, True
    t0 = time.perf_counter()
    for r in rows:
        sums = json.loads(r["checksums"])
        for f in FIELDS:
            remaining = r["num_tokens"] * row_bytes[f]
            crc = 0
            seg = lay.data / r["segment"]
            inner, shard_chunks = field_geometry(seg, f)
            first = r["token_start"] // inner
            for p in sample_files(seg, f, r["token_start"], r["num_tokens"]):  # its shard files, in order
                shard = int(p.name.split(".")[1])
                idx = read_index(p, shard_chunks)
                data = p.read_bytes()
                for k in range(max(first, shard * shard_chunks), (shard + 1) * shard_chunks):
                    if remaining <= 0:
                        break
                    off, n = (int(x) for x in idx[k - shard * shard_chunks])
                    buf = memoryview(decode(data[off : off + n]))
                    take = min(remaining, len(buf))
                    crc = crc32c.crc32c(buf[:take], crc)
                    remaining -= take
                    raw += take
            all_match &= f"crc32c:{crc:08x}" == sums[f]
    return raw, time.perf_counter() - t0, all_match


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--states", type=int, default=4, help="hidden states per token (aux layers + final)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--codec", default="zstd:1")
    ap.add_argument("--jobs", default="1,4", help="comma-separated --jobs values to measure")
    ap.add_argument("--repeat", type=int, default=5, help="best of N timings (interleaved)")
    ap.add_argument("--dir", help="where to build (default: a temporary directory, removed afterwards)")
    args = ap.parse_args(argv)

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hsbuild-bench-verify-"))
    root = base / "build"
    try:
        t0 = time.perf_counter()
        make_build(root, args.samples, args.tokens, args.hidden, args.states, args.chunk_tokens, args.codec)
        per_sample = args.tokens * args.hidden * args.states * 2
        print(f"build: {args.samples} samples x {args.tokens} tokens x hidden {args.hidden} x {args.states} states "
              f"(bf16, {per_sample / MB:.1f} MB/sample), codec {args.codec}, chunk {args.chunk_tokens} tokens; "
              f"written in {time.perf_counter() - t0:.1f}s")
        plain_loop(root, args.codec)  # warm the page cache for both sides
        jobs_list = [int(j) for j in args.jobs.split(",") if j]
        plain_runs: list[tuple[int, float, bool]] = []
        sweeps: dict[int, list] = {j: [] for j in jobs_list}
        for _ in range(args.repeat):  # interleaved, so drift in the machine's speed hits both sides alike
            plain_runs.append(plain_loop(root, args.codec))
            for jobs in jobs_list:
                sweeps[jobs].append(run_sweep(root, SweepOptions(jobs=jobs), echo=lambda m: None))
        raw, secs, ok = max(plain_runs, key=lambda r: r[0] / r[1])
        plain = raw / secs / MB
        print(f"plain loop (read + numcodecs decode + crc32c, 1 thread): {plain:8.1f} MB/s"
              f"  ({raw / MB:.0f} MB in {secs:.2f}s, best of {args.repeat}; checksums {'match' if ok else 'DO NOT match'})")
        for jobs in jobs_list:
            s = max(sweeps[jobs], key=lambda r: r.raw_mb_per_s)
            assert s.ok == args.samples and not s.damaged, s.as_dict()
            print(f"hsbuild verify --jobs {jobs}:{' ' * (28 - len(str(jobs)))}{s.raw_mb_per_s:8.1f} MB/s"
                  f"  ({s.raw_bytes / MB:.0f} MB in {s.seconds:.2f}s)  ratio {s.raw_mb_per_s / plain:.2f}x plain loop")
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
