"""`hsbuild resume` on a complete build: what answering "nothing to do" costs, against start-up and `status`.

    python tools/bench_resume.py --samples 100000          # a quick run
    python tools/bench_resume.py --samples 1000000 --keep /tmp/resume
    (tools/bench_scale.py runs it too, at its --samples)

The build is real: a synthetic source of --samples rows (ids, 16-48 tokens; bench_scale's `make_source`) given
to `init` (built-in model), then a log as one complete run leaves it, written directly with DuckDB (every sample
`started` and `written`, with checksums and detail as a run writes them; a quarter of them `verified`), the
fold checkpointed as an owner's close leaves it. The source is then touched (its content unchanged), so the
first `resume` takes the long way (reads the source, replays the log into a plan, starts a run, which records
the file's identity); every later one answers from the log and one stat of the source (builder/run/settled.py).

Measured in the same run, each a fresh process, wall time (best of --repeat): `hsbuild --version` (the
interpreter and the CLI's imports), `hsbuild status --json`, the first `resume` (the long way) and the later
ones, with the events each added; and what hashing the source file (BLAKE2b, one read) would cost instead of
the stat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

MODEL = "builtin:hidden=64,layers=4,vocab=32768,heads=2,kv_heads=1,intermediate=128"  # (the source's ids < 30003)

EVENTS_SQL = """
CREATE TEMP TABLE s AS
SELECT sample_id AS sid, row_idx AS i, fingerprint AS fp, num_tokens AS ntok, (row_idx % 2)::INTEGER AS w
FROM source_samples;

INSERT INTO events
SELECT {base} + row_number() OVER (ORDER BY phase, i // 64, sub, i), TIMESTAMP '2026-01-01'
       + to_microseconds(2000 * row_number() OVER (ORDER BY phase, i // 64, sub, i)), kind, run_id, sid, fp, attempt,
       w, segment, token_start, num_tokens, nbytes, checksums, NULL, detail
FROM (
  SELECT 0 AS phase, -1 AS i, 0 AS sub, 'run_started' AS kind, 'run-1' AS run_id, NULL AS sid, NULL AS fp,
         NULL::INTEGER AS attempt, NULL::INTEGER AS w, NULL AS segment, NULL::BIGINT AS token_start,
         NULL::BIGINT AS num_tokens, NULL::BIGINT AS nbytes, NULL AS checksums,
         '{{"workers": 2, "resume": false, "config": "synthetic"}}' AS detail
  UNION ALL
  SELECT 1, i, sub, CASE sub WHEN 0 THEN 'started' ELSE 'written' END, 'run-1', sid, fp, 1, w,
         CASE sub WHEN 1 THEN 'seg-run1-w0' || w END, CASE sub WHEN 1 THEN (i // 2) * 64 END,
         CASE sub WHEN 1 THEN ntok END, CASE sub WHEN 1 THEN ntok * 230 END,
         CASE sub WHEN 1 THEN printf('{{"aux_hidden_state": "crc32c:%08x", "hidden_state": "crc32c:%08x", '
                                      '"input_ids": "crc32c:%08x", "loss_mask": "crc32c:%08x"}}',
                                      hash(i) % 4294967296, hash(i + 1) % 4294967296, hash(i + 2) % 4294967296,
                                      hash(i + 3) % 4294967296) END,
         CASE sub WHEN 1 THEN printf('{{"disk_bytes": %d, "seconds": %.4f, "truncated": 0}}', ntok * 240,
                                     (hash(i) % 10000) / 1e4) END
  FROM s, range(2) t(sub)
  UNION ALL
  SELECT 2, {n}, 0, 'run_finished', 'run-1', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
         '{{"written": {n}, "failed": 0, "pauses": 0, "failed_in_build": 0}}'
  UNION ALL
  SELECT 3, -1, 0, 'verify_started', 'verify-1', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '{{}}'
  UNION ALL
  SELECT 4, i, 0, 'verified', 'verify-1', sid, NULL, NULL, w, 'seg-run1-w0' || w, (i // 2) * 64, ntok, ntok * 230,
         NULL, NULL FROM s WHERE i % 4 = 0
  UNION ALL
  SELECT 5, {n}, 0, 'verify_finished', 'verify-1', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '{{}}'
) ORDER BY 1
"""


def make_build(work: Path, n: int) -> dict:
    """A source of n rows, `init` over it, then the log of one complete run (see the module's docstring)."""
    import duckdb  # noqa: PLC0415
    from bench_scale import make_source  # noqa: PLC0415

    from builder.config import Watermarks  # noqa: PLC0415
    from builder.log.events import EventLog  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = make_source(work / f"src-{n}.jsonl", n, 32)
    source_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lay = init_build(work / "build", source, model=MODEL, force=True,
                     watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0))
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    con = duckdb.connect(str(lay.events))
    try:
        base = con.execute("SELECT max(seq) FROM events").fetchone()[0]
        con.execute("BEGIN TRANSACTION")
        con.execute(EVENTS_SQL.format(base=base, n=n))
        con.execute("COMMIT")
    finally:
        con.close()
    with EventLog(lay.events) as log:  # the fold checkpointed, as an owner's close leaves it
        log.checkpoint_fold()
    return {"build": str(lay.root), "source": str(source), "source_s": source_s, "init_s": init_s,
            "synth_s": time.perf_counter() - t0}


def events(build: str) -> int:
    import duckdb  # noqa: PLC0415

    con = duckdb.connect(str(Path(build) / "events.duckdb"), read_only=True)
    try:
        return con.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        con.close()


def hash_file(path: Path) -> tuple[float, int]:
    """Seconds to BLAKE2b the whole file (one read, 1 MiB at a time), and its size."""
    h = hashlib.blake2b(digest_size=16)
    t0 = time.perf_counter()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return time.perf_counter() - t0, size


def measure(n: int, work: Path, repeat: int = 3, rows: list | None = None) -> list[tuple[str, str, str]]:
    """The figures at n samples (a build made under `work`, or re-used there): rows of (what, seconds, note)."""
    from bench_scale import hsbuild, run_cmd  # noqa: PLC0415

    rows = [] if rows is None else rows
    stamp = work / f"resume-{n}.json"
    if stamp.exists() and Path(json.loads(stamp.read_text())["build"], "events.duckdb").exists():
        info = json.loads(stamp.read_text())
        print(f"re-using {info['build']}")
    else:
        cmd = [sys.executable, __file__, "--child", str(work / f"r{n}"), str(n)]
        info = json.loads(run_cmd(cmd, timeout=7200)[0].strip().splitlines()[-1])
        stamp.write_text(json.dumps(info))
        print(f"{n:,} samples: source written in {info['source_s']:.1f} s, init {info['init_s']:.1f} s, "
              f"log synthesized in {info['synth_s']:.1f} s", flush=True)
    build = info["build"]

    def best(cmd: list[str], times: int) -> tuple[float, float, str]:
        walls, out = [], ""
        for _ in range(times):
            out, wall, _ = run_cmd(cmd)
            walls.append(wall)
        return min(walls), max(walls), out

    startup, _, _ = best([*hsbuild(), "--version"], repeat)
    rows.append((f"{n:,}: hsbuild --version (start-up)", f"{startup:.2f}", ""))
    status, worst, _ = best([*hsbuild(), "status", build, "--json"], repeat)
    rows.append((f"{n:,}: hsbuild status --json", f"{status:.2f}", f"worst {worst:.2f} s"))
    # the long way: the source touched (its content unchanged), so the resume reads it whole, replays the log into
    # a plan and starts a run, which records the file's new identity (RACY_SECONDS after the touch: else none)
    from builder.run.settled import RACY_SECONDS  # noqa: PLC0415

    os.utime(info["source"])
    time.sleep(RACY_SECONDS + 0.1)
    before = events(build)
    first, _, out = best([*hsbuild(), "resume", build, "--no-progress"], 1)
    added = events(build) - before
    rows.append((f"{n:,}: resume, the long way (source touched)", f"{first:.2f}",
                 f"{added} event(s) added; {out.strip().splitlines()[-1][:70]}"))
    before = events(build)
    again, worst, out = best([*hsbuild(), "resume", build, "--no-progress"], repeat)
    added = events(build) - before
    rows.append((f"{n:,}: resume, nothing to do", f"{again:.2f}",
                 f"worst {worst:.2f} s; {first / again:.1f}x faster; {again - startup:.2f} s beyond start-up; "
                 f"{added} event(s) added by {repeat}"))
    secs, size = hash_file(Path(info["source"]))
    rows.append((f"{n:,}: BLAKE2b of the source (not done)", f"{secs:.2f}",
                 f"{size / 2**20:,.0f} MiB, {size / secs / 2**20:,.0f} MiB/s (page-cached)"))
    return rows


def show(rows: list[tuple[str, str, str]]) -> None:
    w = [max(len(r[i]) for r in rows) for i in range(2)]
    print(f"\n{'measure':<{w[0]}}  {'seconds':>{w[1]}}  note")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", default="100000", help="comma-separated sizes")
    ap.add_argument("--keep", type=Path, help="work directory to keep (a build of the same size there is re-used)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(make_build(Path(a.child[0]), int(a.child[1]))))
        return
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-resume-"))
    rows: list[tuple[str, str, str]] = []
    try:
        for n in (int(s) for s in a.samples.split(",")):
            measure(n, work, a.repeat, rows)
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    show(rows)


if __name__ == "__main__":
    main()
