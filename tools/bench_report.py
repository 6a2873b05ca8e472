"""`hsbuild report` over a log of about a million events, against a plain query over the same log in the same run.

    python tools/bench_report.py                    # ~1,000,000 events (300,000 samples)
    python tools/bench_report.py --samples 30000    # a quick run
    python tools/bench_report.py --keep /tmp/rep    # keep (and re-use) the synthetic build

The build is real (`init` with the built-in model, a tiny source); its log is then filled by DuckDB alone with
INSERT ... SELECT over range(): tools/bench_scale.py's synthetic history (every sample registered, three runs and two
verify sweeps: started, written with checksums and detail JSON, failures retried and final, transient ones, source
changes, skips, verifications), about 3 events a sample, and the fold's checkpoint taken as an owner closing the
log takes it (--no-fold-checkpoint: cleared, every event folded at each read). Measured in turn, each as a fresh
`hsbuild` process (wall time and CPU time, user + system of all its threads: on a shared machine the CPU time is
the steadier figure; median of --repeat): the baseline `hsbuild sql BUILD "SELECT kind, count(*) FROM events GROUP BY kind"` (start-up,
one open of the log, one pass over it), and `hsbuild report BUILD -o FILE`; then, in this process, where the
report's time goes (the series, the charts, the page). The report must stay under 5 s (issue 45).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

LIMIT_S = 5.0


def wall(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system, all its threads) of one fresh process running `cmd`."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300_000)
    ap.add_argument("--no-fold-checkpoint", action="store_true",
                    help="clear the fold's checkpoint first (a log no owner closed: every event folded)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="make (or re-use) the build under this folder")
    args = ap.parse_args()

    import bench_scale  # noqa: PLC0415 (tools/bench_scale.py: the synthetic log)

    from builder.layout import layout  # noqa: PLC0415
    from builder.report.charts import draw_all  # noqa: PLC0415
    from builder.report.page import render, write_atomic  # noqa: PLC0415
    from builder.report.series import collect  # noqa: PLC0415

    work = args.keep or Path(tempfile.mkdtemp(prefix="hsbuild-bench-report-"))
    build = work / "build"
    if not (build / "events.duckdb").exists():
        made = bench_scale.make_build(work, args.samples)
        print(f"synthetic log: {made['events']:,} events, {args.samples:,} samples, {made['log_bytes'] / 2**20:.0f} "
              f"MiB, made in {made['synth_s']:.1f} s")
    # the fold's checkpoint as a run's end leaves it (an owner closing the log), or none: the whole log folded
    bench_scale.child_fold(str(build), "clear" if args.no_fold_checkpoint else "checkpoint")
    hsb = bench_scale.hsbuild()
    out = work / "report.html"
    base, rep = [], []
    for _ in range(args.repeat):  # taken in turn: both under the same load
        base.append(wall([*hsb, "sql", str(build), "SELECT kind, count(*) FROM events GROUP BY kind"]))
        rep.append(wall([*hsb, "report", str(build), "-o", str(out)]))
    lay = layout(build)
    t0 = time.perf_counter()
    series = collect(lay)
    t1 = time.perf_counter()
    svgs = draw_all(series)
    t2 = time.perf_counter()
    write_atomic(out, render(series, svgs))
    t3 = time.perf_counter()
    b, r = statistics.median(t for t, _ in base), statistics.median(t for t, _ in rep)
    bc, rc = statistics.median(c for _, c in base), statistics.median(c for _, c in rep)
    print(f"events: {series['build']['events']:,}; page {out.stat().st_size / 1e3:.0f} kB; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"baseline  hsbuild sql (count per kind): {b:.2f} s, {bc:.2f} CPU-s (median of {args.repeat})")
    print(f"report    hsbuild report -o FILE:       {r:.2f} s, {rc:.2f} CPU-s (median of {args.repeat}) = "
          f"{r / b:.1f}x the baseline's time, {rc / bc:.1f}x its CPU; limit {LIMIT_S:.0f} s: "
          f"{'OK' if r < LIMIT_S else 'OVER'}")
    print(f"  in process: series {t1 - t0:.2f} s, charts {t2 - t1:.2f} s, page {t3 - t2:.2f} s")
    sys.exit(0 if r < LIMIT_S else 1)


if __name__ == "__main__":
    main()
