"""Write benchmark: hsbuild's durable sample writes (one sample a barrier, committed before the next is encoded;
and `overlap`, as a worker writes: groups of up to GROUP_BYTES made durable on committer threads, up to
COMMITS_IN_FLIGHT at once, while the next samples are encoded) against `torch.save` + fsync (one .pt file a sample, what
EAGLE-3 data pipelines do today) and against a raw sequential write of the same bytes, on the same synthetic
bf16 states, in one run. Prints throughput (MB/s of uncompressed state bytes), ratios and bytes on disk.
Timed: the samples' writes, as a stream (the default 32 samples are 8 extracted ones, repeated), from the first
sample handed over to the last one durable and (hsbuild) committed to the event log. Not timed: what a build does
once (`init` creates the event log) and a worker once a start (it creates its segment): about 50 ms and 10 ms
here, nothing next to a build's millions of samples.

    python tools/bench.py                      # 2048 tokens x 1024 hidden x 4 states a sample, 32 samples
    python tools/bench.py --samples 4 --codecs zstd:1,blosc-lz4:5,none
    python tools/bench.py --states random --hidden 4096   # random normals (the shape of an 8B model)

The states are extracted (`--states extracted`, the default): hsbuild's own Extractor runs the built-in
Llama-architecture model at the benchmark's hidden size (deterministic random weights, no download) over random
token ids, so the codecs see a forward pass's activations (outliers, structure) rather than random normals, which
compress worse than real states and made the default codec look slower than it is. A CPU forward pass at hidden
4096 takes about a minute a sample here, hence the smaller default hidden size for extracted states.

Then, on the same shape, verify throughput against a plain read + decode + crc32c loop (tools/bench_verify.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from builder.extract.model import suggest_chunk_tokens
from builder.fsutil import dir_size, fsync_path
from builder.log.events import Event, EventLog
from builder.run.worker import COMMITS_IN_FLIGHT, GROUP_BYTES
from builder.store.segment import SegmentWriter, init_data_group


def synthetic(tokens: int, hidden: int, layers: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    aux = (torch.randn(tokens, (layers - 1) * hidden, generator=g) * 2).to(torch.bfloat16)
    final = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = np.random.default_rng(seed).integers(0, 150000, tokens).astype(np.int32)
    mask = np.ones(tokens, dtype=np.uint8)
    return ids, mask, aux, final


def extracted(tokens: int, hidden: int, layers: int, count: int, seed: int) -> list[tuple]:
    """`count` samples of states the built-in model computes at this hidden size (layers - 1 aux states + the
    final one; 8 decoder layers), as `synthetic` shapes them."""
    from builder.extract.model import Extractor  # noqa: PLC0415

    heads = max(1, hidden // 128)
    spec = (f"builtin:hidden={hidden},layers=8,vocab=32000,heads={heads},kv_heads={max(1, heads // 4)},"
            f"intermediate={hidden * 11 // 4}")
    ex = Extractor(spec, aux_layers=[2, 4, 6][: layers - 1] or None, device="cpu")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(3, ex.vocab_size, tokens).astype(np.int32)
        aux, final = ex.extract(ids)
        out.append((ids, np.ones(tokens, dtype=np.uint8), aux.to(torch.bfloat16).contiguous(),
                    final.to(torch.bfloat16).contiguous()))
    return out


def logical_bytes(s: tuple) -> int:
    ids, mask, aux, final = s
    return ids.nbytes + mask.nbytes + aux.numel() * 2 + final.numel() * 2


def bench_hsbuild(root: Path, samples: list, codec: str, chunk_tokens: int) -> tuple[float, int]:
    root.mkdir(parents=True)
    data = root / "data"
    init_data_group(data, {})
    log = EventLog(root / "events.duckdb")  # once a build (`init`)
    hidden = samples[0][3].shape[1]
    n_aux = samples[0][2].shape[1] // hidden
    w = SegmentWriter(data, "seg-bench", hidden, n_aux, chunk_tokens, codec).create()  # once a worker start
    t0 = time.perf_counter()
    for i, (ids, mask, aux, final) in enumerate(samples):
        loc = w.write(ids, mask, aux, final)
        log.append([Event("written", sample_id=str(i), segment=loc.segment, token_start=loc.token_start,
                          num_tokens=loc.num_tokens, nbytes=loc.nbytes)])  # commit per sample: worst case
    w.seal()
    dt = time.perf_counter() - t0
    log.close()
    return dt, dir_size(data)


def bench_hsbuild_overlap(root: Path, samples: list, codec: str, chunk_tokens: int) -> tuple[float, int]:
    """As a worker writes: each sample staged (encoded) while the previous group is made durable on a committer
    thread (`SegmentWriter.detach` / `commit`), its `written` events committed once its bytes are durable."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    root.mkdir(parents=True)
    data = root / "data"
    init_data_group(data, {})
    log = EventLog(root / "events.duckdb")  # once a build (`init`)
    hidden = samples[0][3].shape[1]
    n_aux = samples[0][2].shape[1] // hidden
    w = SegmentWriter(data, "seg-bench", hidden, n_aux, chunk_tokens, codec).create()  # once a worker start
    t0 = time.perf_counter()

    appending = threading.Lock()  # one appender at a time, as the coordinator is in a run

    def commit(group, first: int) -> None:
        locs = w.commit(group)
        with appending:
            log.append([Event("written", sample_id=str(first + j), segment=loc.segment,
                              token_start=loc.token_start, num_tokens=loc.num_tokens, nbytes=loc.nbytes)
                        for j, loc in enumerate(locs)])

    pending: deque = deque()
    first = 0
    with ThreadPoolExecutor(COMMITS_IN_FLIGHT) as committer:
        for i, (ids, mask, aux, final) in enumerate(samples):
            w.add(ids, mask, aux, final, sample_id=str(i))
            if w.staged_bytes >= GROUP_BYTES or i == len(samples) - 1:
                while len(pending) >= COMMITS_IN_FLIGHT:  # as many groups committing as in a worker
                    pending.popleft().result()
                pending.append(committer.submit(commit, w.detach(), first))
                first = i + 1
        while pending:
            pending.popleft().result()
    w.seal()
    dt = time.perf_counter() - t0
    log.close()
    return dt, dir_size(data)


def bench_torch_save(root: Path, samples: list) -> tuple[float, int]:
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, (ids, mask, aux, final) in enumerate(samples):
        path = root / f"data_{i}.pt"
        with open(path, "wb") as f:
            torch.save({"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                        "hidden_state": final, "aux_hidden_state": aux}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(root)
    return time.perf_counter() - t0, dir_size(root)


def bench_raw(root: Path, samples: list) -> tuple[float, int]:
    root.mkdir(parents=True)
    path = root / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for ids, mask, aux, final in samples:
            for a in (ids, mask, aux.view(torch.int16).numpy(), final.view(torch.int16).numpy()):
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    fsync_path(root)
    return time.perf_counter() - t0, dir_size(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32, help="samples written (a stream: the first "
                    "--distinct extracted, then repeated)")
    ap.add_argument("--distinct", type=int, default=8, help="samples extracted (a CPU forward pass each)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="aux layers + the final hidden state (2..4)")
    ap.add_argument("--states", choices=["extracted", "random"], default="extracted",
                    help="states of the built-in model (default) or random normals")
    ap.add_argument("--chunk-tokens", type=int, help="default: what `init` would choose")
    ap.add_argument("--codecs", default="blosc-lz4-bitshuffle:5,zstd:1", help="comma-separated codecs to compare")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-verify", action="store_true", help="skip the verify-throughput part (tools/bench_verify.py)")
    ap.add_argument("--dir", help="where to write (default: a temp dir on the current volume)")
    args = ap.parse_args()

    if args.chunk_tokens is None:
        args.chunk_tokens = suggest_chunk_tokens(args.hidden, args.layers - 1, args.tokens)
    t0 = time.perf_counter()
    if args.states == "extracted":
        samples = extracted(args.tokens, args.hidden, args.layers, min(args.samples, args.distinct), 0)
    else:
        samples = [synthetic(args.tokens, args.hidden, args.layers, i) for i in range(min(args.samples,
                                                                                          args.distinct))]
    samples = [samples[i % len(samples)] for i in range(args.samples)]
    made = time.perf_counter() - t0
    total = sum(logical_bytes(s) for s in samples)
    base = Path(tempfile.mkdtemp(prefix="hsbuild-bench-", dir=args.dir or "."))
    print(f"{args.samples} samples x {args.tokens} tokens x {args.hidden} hidden x {args.layers} states, bf16, "
          f"{args.states} ({made:.0f} s to make): {total / 1e6:.0f} MB of states; chunk {args.chunk_tokens} tokens; "
          f"median of {args.repeat} rounds")
    methods = [("torch.save+fsync", lambda d: bench_torch_save(d, samples)),
               ("raw write+fsync", lambda d: bench_raw(d, samples))]
    for codec in args.codecs.split(","):
        methods.append((f"hsbuild {codec}",
                        lambda d, c=codec: bench_hsbuild(d, samples, c, args.chunk_tokens)))
        methods.append((f"hsbuild {codec} overlap",
                        lambda d, c=codec: bench_hsbuild_overlap(d, samples, c, args.chunk_tokens)))
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    sizes: dict[str, int] = {}
    try:
        for r in range(args.repeat):
            order = methods[r % len(methods):] + methods[: r % len(methods)]  # rotate to spread drift
            for i, (name, fn) in enumerate(order):
                d = base / f"r{r}-{i}"
                d.mkdir()
                os.sync()  # (untimed) each method starts with nothing of the previous one's left to write back
                t, b = fn(d / "out")
                times[name].append(t)
                sizes[name] = b
                shutil.rmtree(d, ignore_errors=True)
                os.sync()  # the removal's metadata too
        t_pt, t_raw, b_pt = (statistics.median(times["torch.save+fsync"]), statistics.median(times["raw write+fsync"]),
                             sizes["torch.save+fsync"])
        w = max(len(name) for name, _ in methods)
        print(f"{'method':{w}s} {'MB/s':>8s} {'vs torch.save':>14s} {'vs raw':>8s} {'on disk':>10s} {'vs .pt':>7s}")
        for name, _ in methods:
            t, b = statistics.median(times[name]), sizes[name]
            print(f"{name:{w}s} {total / t / 1e6:8.0f} {t_pt / t:13.2f}x {t_raw / t:7.2f}x {b / 1e6:8.0f} MB "
                  f"{b / b_pt:6.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not args.no_verify:
        import bench_verify  # noqa: PLC0415 - beside this file

        print("\nverify throughput (same shape):")
        bench_verify.main(["--samples", str(args.samples), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
                           "--states", str(args.layers), "--chunk-tokens", str(args.chunk_tokens),
                           "--codec", args.codecs.split(",")[0], "--repeat", str(args.repeat)])


if __name__ == "__main__":
    main()
