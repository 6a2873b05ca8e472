"""Verify throughput: `hsbuild verify` and `hsbuild verify --quick` against plain loops over the same files, on a
synthetic build of bf16 states written as a run writes them (groups of samples sharing shard files).

    python tools/bench_verify.py                                    # 8 samples x 2048 tokens x hidden 4096 x 4 states
    python tools/bench_verify.py --samples 4 --tokens 2200 --hidden 7168    # the seed's shape (4 states)
    python tools/bench_verify.py --samples 100000 --tokens 8-32 --hidden 64 --chunk-tokens 16
    python tools/bench_verify.py --build BUILD      # measure an existing build (e.g. one `hsbuild run` made)

Baselines, measured in the same run over the same files (one thread, no bookkeeping):
- full: each shard file read once, its index decoded, each chunk the samples need decoded with numcodecs, each
  sample's rows of each field checksummed (crc32c) and compared with its `written` event;
- quick: each shard file's size taken and its index read and checked (crc32c), each sample's chunk bytes summed
  and compared with its `written` event, and the segment's metadata files looked at once.
Both sides read from the page cache (the build is read once before timing): the figures compare CPU cost.
The sweep is timed whole (`run_sweep`: the lock, selection, orphan scan, reading, events committed, the log
closed) and its reading phase alone; each ratio is the plain loop's time over the sweep's. MB/s are of uncompressed bytes checked (10^6 bytes); us/sample are wall microseconds per sample.
The headline row is `hsbuild verify` as a user runs it, without --jobs (the row names the readers it picked);
`--jobs N` rows beside it (`--jobs default,1,2`). Rounds are interleaved (the plain loop, then each sweep); each
row gives the ratio of the best times and, per round, the best and median of that round's ratios, and the load
average before and after is printed: on a shared machine the load moves both sides. Under each full row, the
process CPU a sample of each round (every thread's) and the plain loop's CPU over it, round by round: CPU moves
far less with the load than wall time, and a sweep of tiny samples is bound by its own CPU.
"""

from __future__ import annotations

import argparse
import json
import os
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
from builder.extract.samples import Sample, fingerprint  # noqa: E402
from builder.layout import layout  # noqa: E402
from builder.log.events import Event, EventLog, detail  # noqa: E402
from builder.store.segment import (  # noqa: E402
    DIMS,
    FIELDS,
    SegmentWriter,
    init_data_group,
    new_segment_name,
)
from builder.store.shard import EMPTY, decode_index, index_bytes, shard_path  # noqa: E402
from builder.store.zarr_meta import read_array_meta  # noqa: E402
from builder.verify.sweep import SweepOptions, run_sweep  # noqa: E402

MB = 1_000_000


def parse_tokens(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def make_build(root: Path, samples: int, tokens: tuple[int, int], hidden: int, states: int, chunk_tokens: int,
               codec: str, group: int) -> Path:
    """A build whose samples were written by SegmentWriter in groups of `group` (as a run's worker writes them)
    and recorded with `written` events, no model."""
    lay = layout(root)
    root.mkdir(parents=True)
    n_aux = states - 1
    rng = np.random.default_rng(0)
    src = root / "source.jsonl"
    rows = [rng.integers(3, 32000, int(rng.integers(tokens[0], tokens[1] + 1))).astype(np.int32)
            for _ in range(samples)]
    src.write_text("".join(json.dumps({"id": f"b{i:07d}", "input_ids": r.tolist()}) + "\n" for i, r in enumerate(rows)))
    cfg = BuildConfig(source=str(src), model="synthetic", aux_layers=list(range(1, states)), codec=codec,
                      chunk_tokens=chunk_tokens, watermarks=Watermarks(0.997, 0.998, 0.999))
    meta = {"model": "synthetic", "aux_layers": cfg.aux_layers, "hidden_size": hidden, "dtype": "bfloat16",
            "storage_dtype": "uint16", "chunk_tokens": chunk_tokens, "codec": codec}
    init_data_group(lay.data, meta)
    writer = SegmentWriter(lay.data, new_segment_name("bench0000", 0), hidden, n_aux, chunk_tokens, codec).create()
    masks = [np.ones(len(r), np.uint8) for r in rows]
    fps = [fingerprint(r, m) for r, m in zip(rows, masks, strict=True)]
    with EventLog(lay.events) as log:
        log.set_meta(meta)
        log.register_samples([Sample(f"b{i:07d}", i, r, m, fp) for i, (r, m, fp) in enumerate(zip(rows, masks, fps,
                                                                                                strict=True))])
        gen = torch.Generator().manual_seed(0)
        pending: list[Event] = []
        in_group: list[int] = []
        for i, ids in enumerate(rows):
            n = len(ids)
            aux = torch.randn(n, n_aux * hidden, generator=gen).to(torch.bfloat16)
            final = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
            writer.add(ids, masks[i], aux, final, sample_id=f"b{i:07d}", fingerprint=fps[i], attempt=1)
            in_group.append(i)
            if len(in_group) < group and i + 1 < len(rows):
                continue
            for loc, sid in zip(writer.flush(), in_group, strict=True):
                pending.append(Event("written", run_id="bench", sample_id=f"b{sid:07d}", fingerprint=fps[sid],
                                     attempt=1, worker=0, segment=loc.segment, token_start=loc.token_start,
                                     num_tokens=loc.num_tokens, nbytes=loc.nbytes,
                                     checksums=json.dumps(loc.checksums, sort_keys=True), detail=detail(bench=True)))
            in_group = []
            if len(pending) >= 4096 or i + 1 == len(rows):
                log.append(pending)
                pending = []
    writer.seal()
    cfg.save(lay.config)
    return root


def _link_data(src: str, dst: str) -> None:
    """copytree's copy: the data's files hard-linked (never written: shards are write-once), the rest copied."""
    if f"{os.sep}data{os.sep}" in src and f"{os.sep}history{os.sep}" not in src:
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def replicate(root: Path, k: int) -> int:
    """Make the build `k` times as big without writing data: each segment is copied k - 1 times as hard links
    (`seg-...-rN`: the same bytes), and every sample's registration and events are copied with it (ids `ID-rN`,
    new seq numbers). The fold's checkpoint is taken again. Returns the samples the build then holds."""
    import duckdb  # noqa: PLC0415

    lay = layout(root)
    segs = sorted(p.name for p in lay.data.iterdir() if p.name.startswith("seg-"))
    for r in range(1, k):
        for seg in segs:
            shutil.copytree(lay.data / seg, lay.data / f"{seg}-r{r}", copy_function=os.link)
    con = duckdb.connect(str(lay.events))
    try:
        con.execute("BEGIN TRANSACTION")
        n = con.execute("SELECT count(*) FROM source_samples").fetchone()[0]
        for r in range(1, k):
            con.execute(f"INSERT INTO source_samples SELECT sample_id || '-r{r}', row_idx + {r} * {n}, fingerprint, "
                        "num_tokens FROM source_samples WHERE NOT contains(sample_id, '-r')")
            top = con.execute("SELECT max(seq) FROM events").fetchone()[0]
            con.execute(f"""INSERT INTO events SELECT {top} + row_number() OVER (ORDER BY seq), ts, kind, run_id,
                                   sample_id || '-r{r}', fingerprint, attempt, worker,
                                   CASE WHEN segment IS NOT NULL THEN segment || '-r{r}' END, token_start, num_tokens,
                                   nbytes, checksums, reason, detail
                            FROM events WHERE sample_id IS NOT NULL AND NOT contains(sample_id, '-r')
                            ORDER BY seq""")
        con.execute("DELETE FROM fold_checkpoint")
        con.execute("DELETE FROM fold_checkpoint_mark")
        con.execute("COMMIT")
        total = con.execute("SELECT count(*) FROM source_samples").fetchone()[0]
    finally:
        con.close()
    with EventLog(lay.events) as log:
        log.checkpoint_fold()
    return total


def _decoder(meta):
    """The chunk decoder of a field (None: raw bytes)."""
    rest = meta.codecs[1:]
    if not rest:
        return None
    c = rest[0]
    if c["name"] == "zstd":
        return Zstd(level=int(c["configuration"].get("level", 1))).decode
    return Blosc().decode


def _live_rows(root: Path) -> list[dict]:
    with EventLog(layout(root).events, read_only=True) as log:
        return log.query_dicts("SELECT segment, token_start, num_tokens, nbytes, checksums FROM samples "
                               "WHERE state IN ('written', 'verified') ORDER BY segment, token_start")


def _by_shard(rows: list[dict], inner: int, sc: int) -> dict[tuple[str, int], list[int]]:
    """(segment, shard) -> the samples (row indices) with chunks in it, in token order."""
    out: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(rows):
        first = r["token_start"] // inner
        last = (r["token_start"] + max(r["num_tokens"], 1) - 1) // inner
        for s in range(first // sc, last // sc + 1):
            out.setdefault((r["segment"], s), []).append(i)
    return out


def plain_full(root: Path, rows: list[dict]) -> tuple[int, float, bool]:
    """Each shard file read once; the samples' chunks decoded; each sample's rows checksummed and compared."""
    data = layout(root).data
    t0 = time.perf_counter()
    raw, ok = 0, True
    crcs = [dict.fromkeys(FIELDS, 0) for _ in rows]
    metas: dict[str, dict] = {}
    for fld in FIELDS:
        groups: dict[str, dict] = {}
        for seg in {r["segment"] for r in rows}:
            m = metas.setdefault(seg, {f: read_array_meta(data / seg / f) for f in FIELDS})[fld]
            groups[seg] = {"meta": m, "decode": _decoder(m)}
        seg0 = rows[0]["segment"]
        m = groups[seg0]["meta"]
        row_bytes = int(np.prod(m.chunk_shape[1:] or [1])) * m.dtype.itemsize
        for (seg, s), members in sorted(_by_shard(rows, m.chunk_tokens, m.shard_chunks).items()):
            inner, sc, decode = m.chunk_tokens, m.shard_chunks, groups[seg]["decode"]
            whole = (data / seg / shard_path(Path(), fld, DIMS[fld], s)).read_bytes()
            idx = decode_index(whole[-index_bytes(sc):], sc)
            for i in members:
                r = rows[i]
                a, end = r["token_start"], r["token_start"] + r["num_tokens"]
                for k in range(max(a // inner, s * sc), min((end - 1) // inner, (s + 1) * sc - 1) + 1):
                    off, n = (int(x) for x in idx[k - s * sc])
                    assert off != EMPTY
                    buf = memoryview(whole[off : off + n] if decode is None else decode(whole[off : off + n]))
                    lo, hi = max(a, k * inner) - k * inner, min(end, (k + 1) * inner) - k * inner
                    crcs[i][fld] = crc32c.crc32c(buf[lo * row_bytes : hi * row_bytes], crcs[i][fld])
                    raw += (hi - lo) * row_bytes
    for r, c in zip(rows, crcs, strict=True):
        want = json.loads(r["checksums"])
        ok &= all(want[f] == f"crc32c:{c[f]:08x}" for f in FIELDS)
    return raw, time.perf_counter() - t0, ok


def plain_quick(root: Path, rows: list[dict]) -> tuple[float, bool]:
    """Each shard file's size and index (crc32c checked); each sample's chunk bytes summed and compared."""
    data = layout(root).data
    t0 = time.perf_counter()
    got = [0] * len(rows)
    for seg in {r["segment"] for r in rows}:
        for p in [data / seg / "zarr.json", *(data / seg / f / "zarr.json" for f in FIELDS)]:
            os.stat(p)
    for fld in FIELDS:
        m = read_array_meta(data / rows[0]["segment"] / fld)
        inner, sc = m.chunk_tokens, m.shard_chunks
        for (seg, s), members in sorted(_by_shard(rows, inner, sc).items()):
            path = data / seg / shard_path(Path(), fld, DIMS[fld], s)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                idx = decode_index(os.pread(f.fileno(), index_bytes(sc), size - index_bytes(sc)), sc)
            for i in members:
                r = rows[i]
                lo = max(r["token_start"] // inner, s * sc) - s * sc
                hi = min((r["token_start"] + max(r["num_tokens"], 1) - 1) // inner, (s + 1) * sc - 1) - s * sc
                got[i] += int(idx[lo : hi + 1, 1].sum())
    ok = all(g == r["nbytes"] for g, r in zip(got, rows, strict=True))
    return time.perf_counter() - t0, ok


CPU: dict[str, list[float]] = {}  # process CPU seconds of each timed run, by name (see `cpu_line`)


def timed_sweep(root: Path, name: str = "sweep", **kw: object):
    t0, c0 = time.perf_counter(), time.process_time()
    s = run_sweep(root, SweepOptions(**kw), echo=lambda m: None)
    CPU.setdefault(name, []).append(time.process_time() - c0)
    return s, time.perf_counter() - t0


def timed_plain(root: Path, rows: list[dict]) -> tuple[int, float, bool]:
    c0 = time.process_time()
    out = plain_full(root, rows)
    CPU.setdefault("plain", []).append(time.process_time() - c0)
    return out


def cpu_line(name: str, n: int) -> str:
    """CPU a sample (the process's, every thread's: the reader's, the log's), per round, and its ratio to the
    plain loop's in the same round: on a loaded machine wall times move with the load, CPU far less."""
    mine, plain = CPU[name], CPU["plain"]
    per = "/".join(f"{c / n * 1e6:.1f}" for c in mine)
    ratio = "/".join(f"{p / c:.2f}" for p, c in zip(plain, mine, strict=True))
    return f"    CPU {per} us/sample by round; the plain loop's over it: {ratio}x"


def sweep_jobs(root: Path, sweep_id: str) -> int:
    """The readers a sweep used (its `verify_started` records them)."""
    with EventLog(layout(root).events, read_only=True) as log:
        rows = log.query_dicts("SELECT detail FROM events WHERE kind = 'verify_started' AND run_id = ?", [sweep_id])
    return int(json.loads(rows[0]["detail"])["jobs"])


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _ratios(plain: list[float], sweep: list[float]) -> str:
    """Each repeat's plain-loop time over the sweep's (same repeat): best and median."""
    r = sorted(p / w for p, w in zip(plain, sweep, strict=True))
    return f"{r[-1]:.2f}x best, {float(np.median(r)):.2f}x median"


def measure(root: Path, jobs_list: list[int | None], repeat: int, quick: bool = True) -> list[str]:
    """The figures, each against its baseline from the same run: `repeat` interleaved rounds (plain loop, then
    each sweep), so drift in the machine's speed hits both sides alike; the best times and, per round, the ratio
    to that round's plain loop (best and median). `None` in `jobs_list`: the default (no --jobs)."""
    rows = _live_rows(root)
    n = len(rows)
    load0 = _load()
    plain_full(root, rows)  # warm the page cache for both sides
    fulls, quicks = [], []
    sweeps: dict[int | None, list] = {j: [] for j in jobs_list}
    qsweeps: list = []
    for k in range(repeat):
        fulls.append(timed_plain(root, rows))
        for jobs in jobs_list:
            sweeps[jobs].append(timed_sweep(root, f"jobs {jobs}", jobs=jobs))
        if quick:
            quicks.append(plain_quick(root, rows))
            qsweeps.append(timed_sweep(root, quick=True))
        said = [f"plain {fulls[-1][1]:.2f} s"] + [f"{'default' if j is None else f'--jobs {j}'} {sweeps[j][-1][1]:.2f} s "
                                                 f"({fulls[-1][1] / sweeps[j][-1][1]:.2f}x)" for j in jobs_list]
        if quick:
            said.append(f"quick: plain {quicks[-1][0]:.2f} s, sweep {qsweeps[-1][1]:.2f} s")
        print(f"round {k + 1}: " + ", ".join(said) + f"; load {_load()}", file=sys.stderr, flush=True)
    raw, secs, ok = min(fulls, key=lambda r: r[1])
    plain_cpu = "/".join(f"{c / n * 1e6:.1f}" for c in CPU["plain"])
    plain = raw / secs / MB
    ptimes = [f[1] for f in fulls]
    out = [f"{n:,} samples, {raw / MB:,.1f} MB uncompressed ({raw / n:,.0f} B a sample); {repeat} interleaved "
           f"round(s); load average (1/5/15 min) {load0} before, {_load()} after",
           f"plain full loop (read + decode + crc32c, 1 thread): {plain:9.1f} MB/s {secs / n * 1e6:9.1f} us/sample"
           f"  ({secs:.2f} s best, {float(np.median(ptimes)):.2f} s median; checksums "
           f"{'match' if ok else 'DO NOT match'})",
           f"    CPU {plain_cpu} us/sample by round"]
    for jobs in jobs_list:
        s, wall = min(sweeps[jobs], key=lambda r: r[1])
        assert s.ok == n and not s.damaged, s.as_dict()
        walls, reads = [r[1] for r in sweeps[jobs]], [r[0].seconds for r in sweeps[jobs]]
        name = (f"hsbuild verify (default: {sweep_jobs(root, s.sweep_id)} reader(s)):" if jobs is None
                else f"hsbuild verify --jobs {jobs}:")
        out.append(f"{name:<50}{s.raw_bytes / wall / MB:9.1f} MB/s {wall / n * 1e6:9.1f} us/sample  ({wall:.2f} s "
                   f"whole, reading {s.seconds:.2f} s)  ratio {secs / wall:.2f}x plain loop (reading alone "
                   f"{secs / s.seconds:.2f}x); per round: whole {_ratios(ptimes, walls)}, reading "
                   f"{_ratios(ptimes, reads)}")
        out.append(cpu_line(f"jobs {jobs}", n))
    if quick:
        qsecs, qok = min(quicks, key=lambda r: r[0])
        s, wall = min(qsweeps, key=lambda r: r[1])
        assert s.ok == n and not s.damaged, s.as_dict()
        out.append(f"plain quick loop (sizes + shard indexes, 1 thread):{' ' * 15}{qsecs / n * 1e6:9.1f} us/sample"
                   f"  ({qsecs:.2f} s; sizes {'match' if qok else 'DO NOT match'})")
        out.append(f"hsbuild verify --quick (default: {sweep_jobs(root, s.sweep_id)} reader(s)):{' ' * 19}"
                   f"{wall / n * 1e6:9.1f} us/sample  ({wall:.2f} s whole, reading {s.seconds:.2f} s)  ratio "
                   f"{qsecs / wall:.2f}x plain loop (reading alone {qsecs / s.seconds:.2f}x); per round: whole "
                   f"{_ratios([q[0] for q in quicks], [r[1] for r in qsweeps])}")
    return out


def parse_jobs_list(s: str) -> list[int | None]:
    return [None if j == "default" else int(j) for j in s.split(",") if j]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", default="2048", help="tokens a sample, or a range LO-HI (uniform)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--states", type=int, default=4, help="hidden states per token (aux layers + final)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--codec", default="zstd:1")
    ap.add_argument("--group", type=int, default=256, help="samples a group (shared shard files), as a run's")
    ap.add_argument("--jobs", default="default,1,2", help="comma-separated --jobs values to measure; 'default': "
                    "no --jobs (what `hsbuild verify` picks), the headline")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of timings (interleaved): best and median")
    ap.add_argument("--no-quick", action="store_true", help="skip the --quick measurement")
    ap.add_argument("--build", type=Path, help="measure this existing build (copied first: sweeps add events)")
    ap.add_argument("--link", action="store_true", help="with --build: hard-link its data instead of copying "
                    "it (the log is copied either way)")
    ap.add_argument("--replicate", type=int, default=1, help="make the build K times as big (hard-linked segments, "
                    "copied events) before measuring")
    ap.add_argument("--dir", help="where to build (default: a temporary directory, removed afterwards)")
    args = ap.parse_args(argv)

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hsbuild-bench-verify-"))
    root = base / "build"
    try:
        t0 = time.perf_counter()
        if args.build:
            shutil.copytree(args.build, root, ignore=shutil.ignore_patterns(".ballast", "hsbuild.sock"),
                            copy_function=_link_data if args.link else shutil.copy2)
            print(f"build: a copy of {args.build}")
        else:
            lo, hi = parse_tokens(args.tokens)
            make_build(root, args.samples, (lo, hi), args.hidden, args.states, args.chunk_tokens, args.codec,
                       args.group)
            per_sample = (lo + hi) / 2 * args.hidden * args.states * 2
            print(f"build: {args.samples} samples x {args.tokens} tokens x hidden {args.hidden} x {args.states} "
                  f"states (bf16, {per_sample / MB:.3f} MB/sample), codec {args.codec}, chunk {args.chunk_tokens} "
                  f"tokens, groups of {args.group}; written in {time.perf_counter() - t0:.1f}s")
        if args.replicate > 1:
            t0 = time.perf_counter()
            n = replicate(root, args.replicate)
            print(f"replicated {args.replicate} times (hard links, events copied): {n:,} samples, log "
                  f"{layout(root).events.stat().st_size / MB:.1f} MB, in {time.perf_counter() - t0:.1f}s")
        for line in measure(root, parse_jobs_list(args.jobs), args.repeat, not args.no_quick):
            print(line)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
