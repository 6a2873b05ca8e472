"""Re-export benchmark: how long re-running `hsbuild export` into an existing export takes when a small part of
the build changed, against the full export of the same build, measured in the same run.

    python tools/bench_reexport.py                          # 10,000 short samples, 1% changed, speculators
    python tools/bench_reexport.py --format specforge --changed 0.05
    python tools/bench_reexport.py --samples 2000 --keep    # keep the build and the exports (prints the folder)

It makes a real build (builtin model, small and short samples, final state pre-norm so every format can be
exported), then times, each with `export_build` in this process (what `hsbuild export` runs):

1. full: the whole build exported into a new folder;
2. nothing changed: the same export run again (the kept samples' tokens are read for the dataset-wide files;
   nothing written);
3. N% changed: N% of the source rows edited (one token each), `resume --accept-source-changes` re-extracts
   them, and the export run again: those files rewritten, the others kept;
4. N% skipped: N% other samples skipped (`hsbuild skip`), and the export run again: their files removed and
   every later row renumbered (moved, not rewritten).

After each re-export the folder is compared, file by file, with a fresh export of the same build state (that
fresh export's time is printed too). Ratios are re-export / full.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from builder.config import BuildConfig, Watermarks  # noqa: E402
from builder.exchange.export import JOURNAL, ExportOptions, ExportReport, export_build  # noqa: E402
from builder.layout import layout  # noqa: E402
from builder.run.coordinator import RunOptions, run_build  # noqa: E402
from builder.run.create import init_build  # noqa: E402
from builder.run.source_changes import skip_samples  # noqa: E402
from tools.bench_read import rows_for  # noqa: E402 - the same random rows as the read benchmark

ROOMY = Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)  # a benchmark, not a test of watermarks


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def export(build: Path, out: Path, fmt: str) -> tuple[float, ExportReport]:
    t = time.perf_counter()
    rep = export_build(build, out, ExportOptions(format=fmt, allow_overcommit=True, watermarks=ROOMY))
    return time.perf_counter() - t, rep


def same_files(a: Path, b: Path) -> bool:
    def files(d: Path) -> dict[str, bytes]:
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != JOURNAL}

    return files(a) == files(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--changed", type=float, default=0.01, help="share of samples changed (and, then, skipped)")
    ap.add_argument("--format", default="speculators", choices=["specforge", "speculators", "modelopt"])
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="work here (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the build and the exports")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()

    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-reexport-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = rows_for(args)
        src = work / "source.jsonl"
        write_rows(src, rows)
        model = (f"builtin:hidden={args.hidden},layers={args.layers},vocab={args.vocab},heads=2,kv_heads=1,"
                 f"intermediate={2 * args.hidden}")
        t = time.perf_counter()
        build = init_build(work / "build", src, model=model, watermarks=ROOMY, final_state="pre_norm",
                           device="cpu").root
        rep = run_build(build, RunOptions(), echo=lambda m: None)
        if rep.written != args.samples:
            raise SystemExit(f"build: {rep.written} of {args.samples} samples written ({rep.outcome})")
        print(f"build: {args.samples} samples, {args.min_tokens}..{args.max_tokens} tokens, hidden {args.hidden}: "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)

        out = work / "out"
        results: dict[str, dict] = {}
        full, r = export(build, out, args.format)
        results["full export"] = {"seconds": full, "written": r.exported, "rows": r.rows}
        again, r = export(build, out, args.format)
        results["re-export, nothing changed"] = {"seconds": again, "written": r.exported, "rows": r.rows}

        n = max(1, round(args.samples * args.changed))
        rng = random.Random(args.seed)
        picked = rng.sample(range(args.samples), 2 * n)
        changed, skipped = sorted(picked[:n]), sorted(picked[n:])
        for i in changed:
            rows[i]["input_ids"][0] = 3 + (rows[i]["input_ids"][0] + 1) % (args.vocab - 3)
        write_rows(Path(BuildConfig.from_toml(layout(build).config).source), rows)
        rep = run_build(build, RunOptions(accept_source_changes=True), resume=True, echo=lambda m: None)
        if rep.written != n:
            raise SystemExit(f"resume --accept-source-changes: {rep.written} of {n} samples written")
        secs, r = export(build, out, args.format)
        fresh_s, _ = export(build, work / "fresh1", args.format)
        results[f"re-export, {args.changed:.0%} changed"] = {
            "seconds": secs, "written": r.exported, "rewritten": len(r.rewritten), "renumbered": r.renumbered,
            "rows": r.rows, "same_as_fresh": same_files(out, work / "fresh1"), "fresh_export_seconds": fresh_s}

        skip_samples(build, [rows[i]["id"] for i in skipped], "bench_reexport")
        secs, r = export(build, out, args.format)
        fresh_s, _ = export(build, work / "fresh2", args.format)
        results[f"re-export, {args.changed:.0%} skipped"] = {
            "seconds": secs, "written": r.exported, "removed": len(r.removed), "renumbered": r.renumbered,
            "rows": r.rows, "same_as_fresh": same_files(out, work / "fresh2"), "fresh_export_seconds": fresh_s}

        for v in results.values():
            v["ratio_to_full"] = v["seconds"] / full
            if "fresh_export_seconds" in v:
                v["ratio_to_fresh"] = v["seconds"] / v["fresh_export_seconds"]
        if args.json:
            print(json.dumps({"samples": args.samples, "format": args.format, "changed": args.changed,
                              "results": results}, indent=2))
        else:
            print(f"{args.format}, {args.samples} samples of {args.min_tokens}..{args.max_tokens} tokens "
                  f"(hidden {args.hidden}, {args.layers} layers)")
            for name, v in results.items():
                extra = ", ".join(f"{k} {v[k]}" for k in ("written", "rewritten", "removed", "renumbered", "rows",
                                                          "same_as_fresh") if k in v)
                fresh = (f"; a fresh export of that state: {v['fresh_export_seconds']:.2f} s, "
                         f"{v['ratio_to_fresh']:.3f}x") if "fresh_export_seconds" in v else ""
                print(f"  {name:<28} {v['seconds']:8.2f} s  {v['ratio_to_full']:6.3f}x full  ({extra}){fresh}")
        if any(v.get("same_as_fresh") is False for v in results.values()):
            raise SystemExit("a re-export differs from a fresh export of the same build state")
    finally:
        if args.keep:
            print(f"kept: {work}", file=sys.stderr)
        elif not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
