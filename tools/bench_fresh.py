"""Freshness of `sql` and `status` during a run (issue 44, point 4), and what asking costs the run.

    python tools/bench_fresh.py                       # 20,000 tiny samples, asked every 0.5 s
    python tools/bench_fresh.py --samples 200000 --every 1

Two real runs of the same build (the built-in model, hidden 64, 8-32 tokens a sample, `--workers auto`), in
this process's session: one nobody asks, one asked `SELECT count(*) FROM samples WHERE state = 'written'` and
`status` in turn every --every seconds from this process (`run_query` / `status_snapshot`, as the CLI asks). Then,
from the log the run left:

- samples/s of each run (the ratio: what asking costs the run);
- per answer, the lag: the age, when the question was asked, of the oldest committed `written` event the answer
  missed (0 when it missed none; the guarantee is under 2 s, docs/design.md section 6), and how long it took;
- durable -> committed: per sample, its `written` event's commit time minus its group manifest's time (the data
  durable, not yet in the log: not yet "committed", the window a crash would make the next run adopt).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
WRITTEN = "SELECT count(*) FROM samples WHERE state = 'written'"


def hsbuild(*args: str) -> list[str]:
    return [sys.executable, "-m", "builder.cli", *args]


def make_build(root: Path, n: int) -> Path:
    src = root / "source.jsonl"
    if not src.exists():
        r = random.Random(0)
        with src.open("w") as f:
            for i in range(n):
                f.write(json.dumps({"id": i, "input_ids": [r.randrange(2, 1000) for _ in range(r.randint(8, 32))]}) + "\n")
    build = root / f"build-{time.monotonic_ns()}"
    subprocess.run(hsbuild("init", str(build), "--source", str(src), "--model", MODEL), check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return build


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run(build: Path, every: float | None) -> dict:
    """One run of `build`; asked every `every` s when given. Returns its samples/s and the answers."""
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.query import run_query, status_snapshot  # noqa: PLC0415

    lay = layout(build)
    t0 = time.time()
    p = subprocess.Popen(hsbuild("run", str(build), "--no-progress"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    answers: list[tuple[str, float, float, int | None, str]] = []  # what, asked, answered, count, error
    turn = 0
    while p.poll() is None and every is not None:
        time.sleep(every)
        what = ("sql", "status")[turn % 2]
        turn += 1
        asked = time.time()
        try:
            if what == "sql":
                count, note = run_query(lay, WRITTEN)[1][0][0], ""
            else:
                st = status_snapshot(lay)
                count, note = (st.get("written"), "") if st.get("running") else (None, "not running")
        except Exception as e:  # noqa: BLE001 - counted and shown
            count, note = None, f"{type(e).__name__}: {e}"
        answers.append((what, asked, time.time(), count, note))
    err = p.communicate()[1]
    if p.returncode:
        raise SystemExit(f"the run failed ({p.returncode}): {err[-2000:]}")
    rows = run_query(lay, "SELECT ts, sample_id FROM events WHERE kind = 'written' ORDER BY ts")[1]
    stamps = [dt.datetime.fromisoformat(ts).replace(tzinfo=dt.UTC).timestamp() for ts, _ in rows]
    first, last = (stamps[0], stamps[-1]) if stamps else (t0, t0)
    return {"n": len(stamps), "samples_s": len(stamps) / max(last - first, 1e-9), "stamps": stamps,
            "committed": dict((sid, s) for (_, sid), s in zip(rows, stamps, strict=True)), "answers": answers}


def durable_lag(build: Path, committed: dict[str, float]) -> list[float]:
    """Per sample: its `written` commit time minus its group manifest's mtime."""
    out = []
    for manifest in (build / "data").glob("seg-*/samples/*.json"):
        mtime = manifest.stat().st_mtime
        for s in json.loads(manifest.read_text())["samples"]:
            if s["sample_id"] in committed:
                out.append(committed[s["sample_id"]] - mtime)
    return out


def measure_fresh(n: int, every: float = 0.5, work: Path | None = None) -> list[tuple[str, str]]:
    """The figures as (what, value) rows (tools/bench_scale.py prints them in its table)."""
    root = work or Path(tempfile.mkdtemp(prefix="bench-fresh-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        quiet = run(make_build(root, n), None)
        asked_build = make_build(root, n)
        asked = run(asked_build, every)
        dur = durable_lag(asked_build, asked["committed"])
    finally:
        if work is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = [(f"run, {n:,} samples, nobody asks", f"{quiet['samples_s']:,.0f} samples/s"),
            (f"run, asked every {every:g} s (sql, status in turn)",
             f"{asked['samples_s']:,.0f} samples/s ({asked['samples_s'] / quiet['samples_s']:.2f}x)")]
    stamps = asked["stamps"]
    for what in ("sql", "status"):
        mine = [a for a in asked["answers"] if a[0] == what]
        bad = [a for a in mine if a[3] is None and a[4] != "not running"]
        lags, took = [], []
        for _, t_ask, t_ans, count, _ in mine:
            if count is None:
                continue
            missed = [s for s in stamps[count:] if s <= t_ask]  # committed before the question, not in the answer
            lags.append(t_ask - min(missed) if missed else 0.0)
            took.append(t_ans - t_ask)
        rows.append((f"{what}: answers during the run", f"{len(lags)} ({len(bad)} errors: "
                                                         f"{bad[0][4][:80] if bad else '-'})"))
        if lags:
            rows.append((f"{what}: lag (oldest commit missed), median / p99 / max",
                         f"{statistics.median(lags):.2f} / {_pct(lags, .99):.2f} / {max(lags):.2f} s; "
                         f"{sum(x > 2 for x in lags)} over 2 s"))
            rows.append((f"{what}: answered in, median / max", f"{statistics.median(took):.2f} / {max(took):.2f} s"))
    if dur:
        rows.append(("durable -> committed (manifest to `written`), median / p99 / max",
                     f"{statistics.median(dur):.2f} / {_pct(dur, .99):.2f} / {max(dur):.2f} s"))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between two questions")
    ap.add_argument("--keep", type=Path, help="work directory to keep")
    a = ap.parse_args(argv)
    rows = measure_fresh(a.samples, a.every, a.keep)
    w = max(len(r[0]) for r in rows)
    for what, value in rows:
        print(f"{what:<{w}}  {value}")


if __name__ == "__main__":
    main()
