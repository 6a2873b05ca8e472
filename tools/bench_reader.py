"""The trainer's reader at scale: what `HiddenStateDataset`'s index costs to make and to hold, and how fast
DataLoader workers read, against the reader as it was (a dict per sample from the `samples` view: `Legacy`
below, the code of git e888fdf) measured in the same run.

    python tools/bench_reader.py                           # index: 100k and 1M samples; items: 10,000-sample build
    python tools/bench_reader.py --samples 100000 --items 1000
    python tools/bench_reader.py --keep /tmp/bench-reader  # keep (and re-use) the builds

Index (`construct`): a build of N samples whose log is synthesized by tools/bench_scale.py (`make_build`: a
real build, its log then replaced by ~3 events a sample as three runs and two verify sweeps leave them; ~95% of
the samples live), its fold checkpointed as a run's end leaves it. Each measurement is a fresh process: wall and
CPU seconds of the constructor, the index's bytes a sample (its file), and what the process holds after it,
less what it held before (anonymous memory: its own; file-backed: the index file, shared by every process that
maps it) and its peak. `cached`: a second dataset of the same state of the log (the index file mapped);
`to a worker`: pickling the dataset and unpickling it, as a spawned DataLoader worker receives it.

Items (`items`): a real build (built-in model, hidden 64, 8-32 tokens a sample), every item read once through a
DataLoader (`DataLoader(ds, ...)`, and `ds.loader(...)`: its workers send groups) with 0, 2 (forked, spawned) or
4 (forked) workers, one item at a time (`batch_size=None`) in order and shuffled, and as a training job reads,
in shuffled batches of 8 and 32 (`collate_concat`): items/s once every worker
delivered four (the steady rate: a spawned worker first imports torch, seconds; the time to the first is
shown), and over the whole pass, with workers against none in the same run; CPU microseconds an item in the
main process and in the workers (a machine shared with others moves wall times, CPU time much less). Each case
runs --repeat times, the best kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def mem() -> dict[str, int]:
    """This process's resident bytes now: anonymous, file-backed, and its peak."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


# ---------------------------------------------------------------------------------------------------------
# the reader as it was


class Legacy:
    """HiddenStateDataset before its index (format None): its index a dict per row of the samples view."""

    def __init__(self, build):
        from builder.layout import layout  # noqa: PLC0415
        from builder.log.query import run_query  # noqa: PLC0415

        self.lay = layout(build).require()
        cols, rows = run_query(self.lay, "SELECT sample_id, row_idx, segment, token_start, num_tokens, "
                                         "checksums FROM samples WHERE state IN ('written', 'verified') "
                                         "ORDER BY row_idx")
        self.index = [dict(zip(cols, r, strict=True)) for r in rows]
        self._reader = None

    def __len__(self):
        return len(self.index)

    def __setstate__(self, state):  # (a spawned worker imports what the old reader's module imported)
        import builder.reader.dataset  # noqa: F401, PLC0415

        self.__dict__.update(state)

    def __getitem__(self, i):
        from builder.store.reader import SegmentReader  # noqa: PLC0415

        if self._reader is None:
            self._reader = SegmentReader(self.lay.data)
        e = self.index[i]
        t = self._reader.read(e["segment"], e["token_start"], e["num_tokens"], e["checksums"])
        return {"sample_id": e["sample_id"], "input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].long(),
                "hidden_state": t["hidden_state"], "aux_hidden_state": t["aux_hidden_state"]}


def dataset(build: str, impl: str):
    if impl == "legacy":
        return Legacy(build)
    from builder.reader import HiddenStateDataset  # noqa: PLC0415

    return HiddenStateDataset(build)


# ---------------------------------------------------------------------------------------------------------
# children: one measurement each, in a fresh process; they print one JSON line


def child_construct(build: str, impl: str) -> dict:
    import pickle  # noqa: PLC0415

    import duckdb  # noqa: F401, PLC0415 - imported before the baseline: what any reader imports
    import numpy  # noqa: F401, PLC0415
    import pyarrow  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415

    import builder.reader  # noqa: F401, PLC0415
    import builder.reader.snapshot  # noqa: F401, PLC0415

    base = mem()
    w, c = time.perf_counter(), time.process_time()
    ds = dataset(build, impl)
    out = {"n": len(ds), "wall": time.perf_counter() - w, "cpu": time.process_time() - c}
    after = mem()
    out.update(anon=after["RssAnon"] - base["RssAnon"], file=after["RssFile"] - base["RssFile"],
               peak=after["VmHWM"] - base["RssAnon"] - base["RssFile"])
    if impl == "index":
        out["index_bytes"] = ds.index.nbytes
        w = time.perf_counter()
        again = dataset(build, impl)
        out["cached_wall"] = time.perf_counter() - w
        assert len(again) == len(ds)
    w = time.perf_counter()
    blob = pickle.dumps(ds)
    copy = pickle.loads(blob)
    out["worker_wall"], out["pickled"] = time.perf_counter() - w, len(blob)
    assert len(copy) == len(ds)
    return out


def child_items(build: str, impl: str, workers: int, context: str, mode: str) -> dict:
    """One pass over the build through `DataLoader(ds, ...)` (impl "index" or "legacy") or `ds.loader(...)`
    ("loader"); mode: "one" (one item at a time, in order), "one-shuffled", or a batch size (shuffled batches,
    `collate_concat`)."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader  # noqa: PLC0415

    from builder.reader import collate_concat  # noqa: PLC0415

    ds = dataset(build, impl)
    batch = 0 if mode.startswith("one") else int(mode)
    kw: dict = {"num_workers": workers, "batch_size": batch or None}
    if batch:  # as a training job reads: shuffled batches
        kw.update(collate_fn=collate_concat)
    if batch or mode == "one-shuffled":
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(1))
    if workers:
        kw["multiprocessing_context"] = context
    n = len(ds)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    c0, w0 = time.process_time(), time.perf_counter()
    arrivals = []  # (seconds, items so far) at each batch (or item)
    got = 0
    for b in (ds.loader(**kw) if impl == "loader" else DataLoader(ds, **kw)):
        got += len(b["sample_id"]) if batch else 1
        arrivals.append((time.perf_counter() - w0, got))
    wall = time.perf_counter() - w0
    first = arrivals[0][0]
    # once every worker delivered a few (a group of ds.loader's: up to 32 items)
    warm = 4 * max(workers, 1) * (32 if impl == "loader" and not batch else 1)
    since, items = arrivals[min(warm, len(arrivals)) - 1]
    main = time.process_time() - c0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the workers, joined at the end of the pass)
    kids = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    assert got == n
    return {"n": n, "items_s": n / wall, "steady_s": (n - items) / max(wall - since, 1e-9), "first": first,
            "main_us": main / n * 1e6, "workers_us": kids / n * 1e6}


def run_child(args: list[str], env: dict | None = None, timeout: float = 3600) -> dict:
    import subprocess  # noqa: PLC0415

    p = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: exit {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------
# builds


def synthetic(work: Path, n: int) -> str:
    """A build of n samples with a synthesized log (tools/bench_scale.py), its fold checkpointed."""
    import bench_scale  # noqa: PLC0415

    stamp = work / f"synth-{n}.json"
    if stamp.exists():
        info = json.loads(stamp.read_text())
        if Path(info["build"], "events.duckdb").exists():
            return info["build"]
    info = bench_scale.run_child(["build", str(work / f"synth-{n}"), str(n)])[0]
    bench_scale.run_child(["fold", info["build"], "checkpoint"])
    stamp.write_text(json.dumps(info))
    return info["build"]


def real(work: Path, n: int) -> str:
    """A build of n short samples (8-32 tokens) of the built-in model, extracted."""
    import random  # noqa: PLC0415

    build = work / f"real-{n}" / "build"
    stamp = work / f"real-{n}.done"
    if stamp.exists():
        return str(build)
    shutil.rmtree(build.parent, ignore_errors=True)
    build.parent.mkdir(parents=True)
    rng = random.Random(1)
    src = build.parent / "source.jsonl"
    src.write_text("".join(json.dumps({"id": f"s{i:07d}", "input_ids": [rng.randint(3, 1000) for _ in
                                                                         range(rng.randint(8, 32))]}) + "\n"
                           for i in range(n)))
    from builder.config import Watermarks  # noqa: PLC0415
    from builder.run.coordinator import RunOptions, run_build  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415

    init_build(build, src, model=MODEL, watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0))
    res = run_build(build, RunOptions(), echo=lambda m: None)
    assert res.written == n, res
    stamp.write_text("")
    return str(build)


# ---------------------------------------------------------------------------------------------------------


def size(v: float, n: int) -> str:
    return f"{v / 2**20:,.0f} MiB ({v / n:,.0f} B/sample)"


def measure_construct(build: str, rows: list, repeat: int = 1) -> dict:
    """Construct the legacy and the index reader on `build` (fresh processes, a fresh cache each): rows of
    (what, seconds, note); returns {impl: its measures}."""
    res = {}
    for impl in ("legacy", "index"):
        best = None
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(prefix="bench-reader-cache-") as cache:
                r = run_child(["construct", build, impl], env={"HSBUILD_CACHE_DIR": cache})
            best = r if best is None or r["wall"] < best["wall"] else best
        res[impl] = best
    old, new = res["legacy"], res["index"]
    n = new["n"]
    rows.append((f"reader construct, {n:,} live samples: legacy", f"{old['wall']:.2f}",
                 f"cpu {old['cpu']:.2f} s; holds {size(old['anon'], n)} after, peak {size(old['peak'], n)}; "
                 f"to a spawned worker {old['worker_wall']:.2f} s, {size(old['pickled'], n)} pickled"))
    rows.append(("  index", f"{new['wall']:.2f}",
                 f"cpu {new['cpu']:.2f} s ({old['cpu'] / new['cpu']:.1f}x less CPU); index file "
                 f"{size(new['index_bytes'], n)}, mapped (shared); holds {size(new['anon'], n)} anonymous + "
                 f"{new['file'] / 2**20:,.0f} MiB file-backed after, peak {size(new['peak'], n)}; cached "
                 f"{new['cached_wall']:.2f} s; to a worker {new['worker_wall'] * 1e3:.0f} ms, {new['pickled']:,} B"))
    return res


def marginal(a: dict, b: dict, rows: list) -> None:
    """What a sample more costs, from two sizes (the fixed part, e.g. modules imported, cancels out)."""
    for impl in ("legacy", "index"):
        x, y = a[impl], b[impl]
        dn = y["n"] - x["n"]
        parts = [f"held {(y['anon'] - x['anon']) / dn:,.0f} B/sample anonymous"]
        if impl == "index":
            parts.append(f"+ {(y['index_bytes'] - x['index_bytes']) / dn:,.0f} B/sample of index file")
        parts.append(f"peak {(y['peak'] - x['peak']) / dn:,.0f} B/sample; CPU "
                     f"{(y['cpu'] - x['cpu']) / dn * 1e6:,.2f} s per million samples")
        rows.append((f"  a sample more, {impl} ({x['n']:,} -> {y['n']:,})", "", ", ".join(parts)))


MODES = {"one": "one at a time, in order", "one-shuffled": "one at a time, shuffled", "8": "shuffled batches of 8",
         "32": "shuffled batches of 32"}


def measure_items(build: str, rows: list, repeat: int, impls: tuple[str, ...]) -> None:
    """Each case for each reader (`DataLoader(ds, ...)` over the legacy reader or the index, and `ds.loader(...)`);
    for each way of reading, every case's runs interleaved with the others' (no workers, 2, 4: the machine's
    load drifts), the best of `repeat` kept; each against no workers (a plain DataLoader) in the same run."""
    loaders = ((0, "-"), (2, "fork"), (2, "spawn"), (4, "fork"))
    impls = tuple(dict.fromkeys(("index", *impls) if "loader" in impls else impls))  # (ds.loader is against it)
    cases = [(w, c, impl) for w, c in loaders for impl in impls if w or impl != "loader"]  # (no workers: a DataLoader)
    for mode, said in MODES.items():
        best: dict = {}
        for _ in range(repeat):
            for key in cases:
                workers, ctx, impl = key
                r = run_child(["items", build, impl, str(workers), ctx, mode])
                if key not in best or r["steady_s"] > best[key]["steady_s"]:
                    best[key] = r
        for key in cases:
            workers, ctx, impl = key
            r = best[key]
            base = best[(0, "-", "legacy" if impl == "legacy" else "index")]
            name = {"loader": "ds.loader", "index": "DataLoader", "legacy": "DataLoader, legacy"}[impl]
            what = f"items, {said}: {name}, " + (f"{workers} workers ({ctx})" if workers else "no workers")
            ratio = f" ({r['steady_s'] / base['steady_s']:.2f}x no workers)" if workers else ""
            if impl == "loader":
                ratio += f" ({r['steady_s'] / best[(workers, ctx, 'index')]['steady_s']:.2f}x DataLoader)"
            rows.append((what, f"{r['steady_s']:,.0f}/s",
                         f"steady{ratio}; first after {r['first']:.2f} s; whole pass {r['items_s']:,.0f}/s; "
                         f"cpu/item main {r['main_us']:.0f} us, workers {r['workers_us']:.0f} us"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", default="100000,1000000", help="sizes of the synthetic builds (index)")
    ap.add_argument("--items", type=int, default=10000, help="samples of the real build read through a DataLoader")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--readers", default="index,loader",
                    help="items: DataLoader over the index (index), ds.loader (loader), the legacy reader (legacy)")
    ap.add_argument("--keep", type=Path, help="work directory to keep (builds there are re-used)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "construct":
            res = child_construct(*rest)
        else:
            build, impl, workers, ctx, mode = rest
            res = child_items(build, impl, int(workers), ctx, mode)
        print(json.dumps(res))
        return
    load = os.getloadavg()
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-reader-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str]] = []
    try:
        sizes = []
        for n in [int(x) for x in a.samples.split(",") if x and int(x) > 0]:  # (--samples 0 or "": items only)
            sizes.append(measure_construct(synthetic(work, n), rows, a.repeat))
        if len(sizes) >= 2:
            marginal(sizes[0], sizes[-1], rows)
        if a.items:
            measure_items(real(work, a.items), rows, a.repeat, tuple(a.readers.split(",")))
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print_rows(rows)
    end = os.getloadavg()
    print(f"load average (1 min / 15 min) on {os.cpu_count()} cores: {load[0]:.1f} / {load[2]:.1f} at the start, "
          f"{end[0]:.1f} / {end[2]:.1f} at the end")


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]}")


if __name__ == "__main__":
    main()
