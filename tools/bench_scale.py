"""Scale of the log and the source: resume planning, `status` and `sql` over a build of a million samples, and
what loading a source of that size costs in memory.

    python tools/bench_scale.py                        # 1,000,000 samples (a few minutes on 2 cores)
    python tools/bench_scale.py --samples 100000       # a quick run
    python tools/bench_scale.py --keep /tmp/scale      # keep (and re-use) the synthetic build and sources

The build is real (`init` with the built-in model, a tiny source) and its event log is then replaced by a
synthetic one written directly with DuckDB: every sample registered in `source_samples` and ~3 events each,
as three runs and two verify sweeps would leave them (started, written with checksums and detail JSON, some
failed and retried, some failed for good, interrupted, damaged, retired, superseded, moved, verified).

Each measurement runs in its own fresh process; its peak RSS is that process's ru_maxrss (os.wait4):

- plan: `make_plan` (the replay `resume` does) given the samples as a run holds its source (`SourceSamples`:
  columns, one token a sample: the plan's own cost, not the source's); building them is timed apart.
- status / sql: `hsbuild status BUILD --json` and `hsbuild sql BUILD "SELECT state, count(*) FROM samples GROUP
  BY 1"` as subprocesses, wall time; `hsbuild --version` (interpreter start-up and imports) is shown apart.
- reader: `HiddenStateDataset`'s index made over the same log, against the reader as it was
  (tools/bench_reader.py, which also measures items/s through DataLoader workers on a real build).
- resume: `hsbuild resume` on a complete build of a real source of the same size, the long way and with nothing
  to do, against `hsbuild --version` and `status` (tools/bench_resume.py, its own build).
- --log-size: what a sample costs in the log of a real build, after its run and after a full verify, part by
  part (tools/bench_logsize.py).
- source: `load_source` (every sample's tokens held as numpy arrays) of a synthetic JSONL / Parquet source of
  the same number of rows (--source-tokens tokens each, on average), and of one with 8x fewer rows and 8x more
  tokens: from the two, bytes per row and per token, extrapolated to --extrapolate-tokens tokens a row. With
  builder.extract.source_index present, its streaming `scan_source` is measured on the same files.
- fresh (--fresh): a real run asked `sql` and `status` while it writes: how old what they miss is, and its
  samples/s against a run nobody asks (tools/bench_fresh.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def rss_now() -> int:
    """Resident bytes of this process now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------------
# the synthetic build
# ---------------------------------------------------------------------------------------------------------

# per sample, r = hash(i) % 1000 picks its history (per mille)
HISTORY_SQL = """
CREATE TEMP TABLE cls AS
SELECT i, 'sample-' || lpad(i::VARCHAR, 8, '0') AS sid, printf('%016x', hash(i)) AS fp,
       printf('%016x', hash(i + 77777777)) AS fp2,
       (64 + hash(i + 1) % 4000)::BIGINT AS ntok, (hash(i * 3 + 7) % 1000)::INTEGER AS r,
       (i % 8)::INTEGER AS w
FROM range({n}) t(i);

CREATE TEMP TABLE ev AS
WITH
s AS (SELECT * FROM cls WHERE r >= 20),                                -- 2% never started (pending)
-- (checksums as a run stores them: the four CRC-32C's 32 hex digits, input_ids, loss_mask, hidden_state,
-- aux_hidden_state: builder/log/checksums.py)
ck AS (SELECT *, printf('%08x%08x%08x%08x', hash(i + 2) % 4294967296, hash(i + 3) % 4294967296,
                        hash(i + 1) % 4294967296, hash(i) % 4294967296) AS checksums,
              printf('{{"disk_bytes": %d, "seconds": %.4f, "truncated": false}}',
                     ntok * 24576 + 4096, (hash(i) % 10000) / 1e4) AS wdetail FROM s),
-- run 1: every started sample, with its outcome
r1s AS (SELECT 1 AS phase, i, 0 AS sub, 'started' AS kind, 'run-1' AS run_id, sid, fp, 1 AS attempt, w,
               NULL AS segment, NULL::BIGINT AS token_start, NULL::BIGINT AS num_tokens, NULL::BIGINT AS nbytes,
               NULL AS checksums, NULL AS reason,
               CASE WHEN r BETWEEN 95 AND 99 THEN '{{"origin": "import"}}' END AS detail FROM ck),
r1o AS (SELECT 1, i, 1, k, 'run-1', sid, fp, 1, w,
               CASE WHEN k = 'written' THEN 'run-1-w' || w END, CASE WHEN k = 'written' THEN i * 4096 END,
               CASE WHEN k = 'written' THEN ntok END, CASE WHEN k = 'written' THEN ntok * 24000 END,
               CASE WHEN k = 'written' THEN checksums END,
               CASE WHEN k = 'failed' THEN (CASE WHEN r < 70 THEN 'nonfinite' WHEN r < 80 THEN 'no_space'
                                                 ELSE 'too_long' END) END,
               CASE WHEN k = 'written' THEN wdetail ELSE '{{"message": "synthetic failure"}}' END
        FROM (SELECT *, CASE WHEN r < 30 THEN NULL WHEN r < 70 OR (r >= 75 AND r < 85) THEN 'failed'
                             ELSE 'written' END AS k FROM ck)),
-- source changes accepted between the runs
src AS (SELECT 2, i, 0, CASE WHEN r < 85 THEN 'retired' WHEN r < 90 THEN 'row_moved' ELSE 'superseded' END,
               'run-2', sid, CASE WHEN r < 90 THEN fp ELSE fp2 END, NULL, NULL, NULL, NULL,
               CASE WHEN r >= 85 THEN ntok END, NULL, NULL,
               CASE WHEN r < 85 THEN 'skipped' WHEN r >= 90 THEN 'source_changed' END,
               CASE WHEN r < 85 THEN '{{"note": "too long for the model"}}' ELSE printf('{{"row": %d}}', i) END
        FROM ck WHERE r BETWEEN 80 AND 94),
-- run 2: interrupted ones started again (left in flight), failures retried, superseded ones extracted again
r2s AS (SELECT 3, i, 0, 'started', 'run-2', sid, CASE WHEN r >= 90 THEN fp2 ELSE fp END, 2, w, NULL, NULL, NULL,
               NULL, NULL, NULL, NULL FROM ck WHERE r BETWEEN 20 AND 69 OR r BETWEEN 90 AND 94),
r2o AS (SELECT 3, i, 1, CASE WHEN r >= 60 AND r < 70 THEN 'failed' ELSE 'written' END, 'run-2', sid,
               CASE WHEN r >= 90 THEN fp2 ELSE fp END, 2, w, 'run-2-w' || w, i * 4096, ntok, ntok * 24000,
               checksums, CASE WHEN r >= 60 AND r < 70 THEN 'nonfinite' END, wdetail FROM ck WHERE r BETWEEN 30 AND 69 OR r BETWEEN 90 AND 94),
-- run 3: the last attempt of the samples that always fail
r3 AS (SELECT 4, i, sub, CASE sub WHEN 0 THEN 'started' ELSE 'failed' END, 'run-3', sid, fp, 3, w, NULL, NULL,
              NULL, NULL, NULL, CASE sub WHEN 1 THEN 'nonfinite' END,
              CASE sub WHEN 1 THEN '{{"message": "hidden state holds NaN"}}' END
       FROM ck, range(2) u(sub) WHERE r BETWEEN 60 AND 69),
-- verify sweeps: most written samples verified once, a third twice; 0.5% found damaged
v1 AS (SELECT 5, i, 0, CASE WHEN r < 75 THEN 'failed' ELSE 'verified' END, 'verify-1', sid, fp, NULL, w,
              'run-1-w' || w, i * 4096, ntok, ntok * 24000, NULL,
              CASE WHEN r < 75 THEN 'checksum_mismatch' END, NULL
       FROM ck WHERE r BETWEEN 70 AND 74 OR r BETWEEN 95 AND 699),
v2 AS (SELECT 6, i, 0, 'verified', 'verify-2', sid, fp, NULL, w, 'run-1-w' || w, i * 4096, ntok, ntok * 24000,
              NULL, NULL, NULL FROM ck WHERE r BETWEEN 100 AND 399),
runs AS (SELECT phase, -64 AS i, 0 AS sub, k AS kind, run AS run_id, NULL AS sid, NULL AS fp, NULL::INTEGER, NULL::INTEGER,
                NULL, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL, reason,
                '{{"workers": 8, "config": "synthetic"}}' FROM (VALUES
                (1, 'run_started', 'run-1', NULL), (3, 'run_started', 'run-2', NULL),
                (4, 'run_started', 'run-3', NULL), (5, 'verify_started', 'verify-1', NULL),
                (6, 'verify_started', 'verify-2', NULL)) v(phase, k, run, reason)
         UNION ALL
         SELECT phase, {n} + 1, 9, k, run, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, reason, NULL
         FROM (VALUES (1, 'run_finished', 'run-1', 'interrupted'), (3, 'run_finished', 'run-2', 'interrupted'),
                      (4, 'run_finished', 'run-3', 'completed'), (5, 'verify_finished', 'verify-1', 'damage_found'),
                      (6, 'verify_finished', 'verify-2', 'completed')) v(phase, k, run, reason))
SELECT * FROM (
    SELECT * FROM r1s UNION ALL SELECT * FROM r1o UNION ALL SELECT * FROM src UNION ALL SELECT * FROM r2s
    UNION ALL SELECT * FROM r2o UNION ALL SELECT * FROM r3 UNION ALL SELECT * FROM v1 UNION ALL SELECT * FROM v2
    UNION ALL SELECT * FROM runs) WHERE kind IS NOT NULL;
"""


def make_build(root: Path, n: int) -> dict:
    """A real build (built-in model, a 4-row source), then its registry and log replaced by synthetic ones."""
    import duckdb  # noqa: PLC0415

    from builder.config import Watermarks  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    tiny = root / "tiny-source.jsonl"
    tiny.write_text("".join(json.dumps({"input_ids": [3, 4, 5, 6]}) + "\n" for _ in range(4)))
    lay = init_build(root / "build", tiny, model="builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,"
                     "intermediate=128", watermarks=Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0),
                     force=True)
    t0 = time.perf_counter()
    con = duckdb.connect(str(lay.events))
    try:
        con.execute("BEGIN TRANSACTION")
        con.execute("DELETE FROM source_samples")  # the tiny source's rows (they have no events)
        con.execute(HISTORY_SQL.format(n=n))
        con.execute("INSERT INTO source_samples SELECT sid, i, fp, ntok FROM cls ORDER BY i")
        base = con.execute("SELECT max(seq) FROM events").fetchone()[0]
        con.execute(f"""
            INSERT INTO events
            SELECT {base} + row_number() OVER (ORDER BY phase, i // 64, sub, i) AS seq,
                   TIMESTAMP '2026-01-01' + to_microseconds(2000 * row_number() OVER (ORDER BY phase, i // 64, sub, i)),
                   kind, run_id, sid, fp, attempt, w, segment, token_start, num_tokens, nbytes, checksums, reason,
                   detail
            FROM ev ORDER BY seq""")
        con.execute("COMMIT")
        con.execute("CHECKPOINT")
        events = con.execute("SELECT count(*) FROM events").fetchone()[0]
        states = dict(con.execute("SELECT state, count(*) FROM samples GROUP BY 1").fetchall())
    finally:
        con.close()
    return {"build": str(lay.root), "events": events, "states": states,
            "synth_s": time.perf_counter() - t0, "log_bytes": lay.events.stat().st_size}


def make_source(path: Path, rows: int, tokens: int) -> Path:
    """`rows` samples with ids, input_ids (tokens/2 .. 3*tokens/2 of them) and a loss mask, written by DuckDB."""
    import duckdb  # noqa: PLC0415

    if path.exists():
        return path
    fmt = "parquet" if path.suffix == ".parquet" else "json"
    tmp = path.with_name(path.name + ".tmp")
    con = duckdb.connect()
    try:
        con.execute(f"""
            COPY (SELECT 'sample-' || lpad(i::VARCHAR, 8, '0') AS id,
                         list_transform(range(n), lambda x: (3 + hash(i * 7919 + x) % 30000)::INTEGER) AS input_ids,
                         list_transform(range(n), lambda x: (x >= n // 3)::INTEGER) AS loss_mask
                  FROM (SELECT i, ({tokens} // 2 + hash(i) % ({tokens} + 1))::BIGINT AS n FROM range({rows}) t(i)))
            TO '{tmp}' (FORMAT {fmt})""")
    finally:
        con.close()
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------------------
# children: one measurement each, in a fresh process; they print one JSON line
# ---------------------------------------------------------------------------------------------------------


def child_plan(build: str) -> dict:
    import numpy as np  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415

    from builder.extract.samples import SourceSamples  # noqa: PLC0415
    from builder.log.events import open_log  # noqa: PLC0415
    from builder.run.plan import make_plan  # noqa: PLC0415

    base = rss_now()
    events = Path(build) / "events.duckdb"
    with open_log(events, read_only=True) as log:
        ids, fps = log.query("SELECT list(sample_id ORDER BY row_idx), list(fingerprint ORDER BY row_idx) "
                             "FROM source_samples")[1][0]
    t0 = time.perf_counter()
    n = len(ids)  # held as a run holds its source: columns (one token a sample here)
    samples = SourceSamples(pa.array(ids, pa.string()), pa.array(fps, pa.string()), np.arange(n), np.arange(n),
                            np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int32), np.ones(n, dtype=np.uint8))
    del ids, fps
    list_s = time.perf_counter() - t0
    list_rss = rss_now() - base
    t0 = time.perf_counter()
    with open_log(events) as log:  # as a run opens it: for writing
        open_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = make_plan(log, samples, 3)
        plan_s = time.perf_counter() - t1
    return {"list_s": list_s, "list_rss": list_rss, "open_s": open_s, "plan_s": plan_s, "summary": plan.summary(),
            "peak_rss": peak_rss()}


def child_source(path: str, fn: str) -> dict:
    import gc  # noqa: PLC0415

    base = rss_now()
    t0 = time.perf_counter()
    if fn == "load_source":
        from builder.extract.source import load_source  # noqa: PLC0415

        base = rss_now()
        t0 = time.perf_counter()
        samples = load_source(path)
        n, tokens = len(samples), sum(s.num_tokens for s in samples)
    else:
        from builder.extract.source_index import scan_source  # noqa: PLC0415

        base = rss_now()
        t0 = time.perf_counter()
        n = tokens = 0
        for batch in scan_source(path):
            n += len(batch)
            tokens += sum(r.num_tokens for r in batch)
        samples = None
    secs = time.perf_counter() - t0
    gc.collect()
    return {"s": secs, "rows": n, "tokens": tokens, "held_rss": rss_now() - base, "base_rss": base,
            "peak_rss": peak_rss(), "held": samples is not None}


def child_fold(build: str, op: str) -> dict:
    """Clear the fold's checkpoint (changes no answer, only speed), or take one as an owner closing would."""
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.events import EventLog  # noqa: PLC0415

    path = layout(build).events
    before = path.stat().st_size
    t0 = time.perf_counter()
    with EventLog(path) as log:
        if op == "clear":
            log.con.execute("BEGIN TRANSACTION")
            log.con.execute("DELETE FROM fold_checkpoint")
            log.con.execute("DELETE FROM fold_checkpoint_mark")
            log.con.execute("COMMIT")
            log._fold_upto = 0
            log.con.execute("CHECKPOINT")
        else:
            log.checkpoint_fold()
            log.con.execute("CHECKPOINT")
        secs = time.perf_counter() - t0
        log._fold_upto = log._seq  # closing must not checkpoint again (the cleared build stays cleared)
    return {"s": secs, "before": before, "after": path.stat().st_size}


def measure_log(build: str, repeat: int, startup: float, rows: list) -> None:
    res, wall, rss = run_child(["plan", build])
    rows.append(("make_plan (resume's replay)", f"{res['plan_s']:.2f}", mib(rss),
                 f"open log {res['open_s']:.2f} s; todo {res['summary']['todo']:,}, done {res['summary']['done']:,}"))
    rows.append(("  the samples (columns, index only)", f"{res['list_s']:.2f}", mib(res["list_rss"]) + " held",
                 "the plan's input, 1 token each"))
    for name, cmd in (("hsbuild status --json", [*hsbuild(), "status", build, "--json"]),
                      ("hsbuild sql (state counts)", [*hsbuild(), "sql", build,
                                                      "SELECT state, count(*) FROM samples GROUP BY 1"])):
        walls, peak, out = [], 0, ""
        for _ in range(repeat):
            out, wall, rss = run_cmd(cmd)
            walls.append(wall)
            peak = max(peak, rss)
        rows.append((name, f"{min(walls):.2f}", mib(peak),
                     f"worst {max(walls):.2f} s; less start-up {min(walls) - startup:.2f} s"))
        if name.startswith("hsbuild status"):
            st = json.loads(out)
            print(f"status: total {st['total']:,}, done {st['done']:,}, failed {st['failed']:,}, "
                  f"retired {st['retired']:,}, failed_by_reason {st.get('failed_by_reason')}")


def run_child(args: list[str], timeout: float = 3600) -> tuple[dict, float, int]:
    """(its JSON, wall seconds, peak RSS bytes) of `python bench_scale.py --child ...`."""
    return run_cmd([sys.executable, __file__, "--child", *args], timeout, parse=True)


def run_cmd(cmd: list[str], timeout: float = 600, parse: bool = False) -> tuple[dict | str, float, int]:
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            p.kill()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, etext = out.read().decode(), err.read().decode()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}...: exit {p.returncode}: {etext[-2000:]}")
    res = json.loads(text.strip().splitlines()[-1]) if parse else text
    return res, wall, ru.ru_maxrss * 1024


def hsbuild() -> list[str]:
    exe = Path(sys.executable).with_name("hsbuild")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "builder.cli"]


# ---------------------------------------------------------------------------------------------------------


def measure_verify(n: int) -> None:
    """verify against its baselines (tools/bench_verify.py), at n tiny samples and at the seed's shape."""
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_verify as bv  # noqa: PLC0415

    for label, args in ((f"{n:,} samples of 8-32 tokens, hidden 64",
                         ["--samples", str(max(n // 10, 1)), "--replicate", str(min(n, 10)), "--tokens", "8-32",
                          "--hidden", "64", "--chunk-tokens", "16", "--codec", "blosc-lz4-bitshuffle:5",
                          "--jobs", "default,1,2", "--repeat", "1"]),
                        ("the seed's shape: 12 samples of 2,200 tokens x hidden 7168",
                         ["--samples", "12", "--tokens", "2200", "--hidden", "7168", "--jobs", "default,1,2", "--repeat", "3"])):
        print(f"\nverify, {label}:", flush=True)
        bv.main(args)


def measure_export(n: int) -> None:
    """A file-per-sample export against plain write loops (tools/bench_export.py): tiny samples, the seed's shape."""
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_export  # noqa: PLC0415

    print(f"\nexport, {min(n, 20_000):,} samples of 8-32 tokens, then the seed's shape:", flush=True)
    bench_export.main(["--samples", str(min(n, 20_000)), "--format", "specforge,speculators", "--seed-shape"])


def mib(b: float) -> str:
    return f"{b / MiB:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="work directory to keep (a build of the same size there is re-used)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each status/sql measurement (best and worst shown)")
    ap.add_argument("--source-tokens", type=int, default=32, help="mean tokens a row of the synthetic source")
    ap.add_argument("--source-formats", default="parquet,jsonl")
    ap.add_argument("--extrapolate-tokens", type=int, default=2048)
    ap.add_argument("--fresh", action="store_true", help="freshness of sql/status during a real run of up to "
                    "100,000 samples, and what asking costs it (tools/bench_fresh.py)")
    ap.add_argument("--no-source", action="store_true", help="skip the source measurements")
    ap.add_argument("--verify", action="store_true", help="measure verify too (writes about 9 KB a sample)")
    ap.add_argument("--export", action="store_true", help="measure a file-per-sample export too (tools/bench_export.py)")
    ap.add_argument("--no-reader", action="store_true", help="skip the reader's index (tools/bench_reader.py)")
    ap.add_argument("--no-resume", action="store_true", help="skip resume on a complete build (tools/bench_resume.py)")
    ap.add_argument("--log-size", action="store_true", help="measure what a sample costs in the log on a real build "
                    "of --samples samples: a run and a full verify (tools/bench_logsize.py; about 6 min at 100k)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child  # the parent stays small: a child's ru_maxrss counts the parent's RSS at fork
        if kind == "build":
            res = make_build(Path(rest[0]), int(rest[1]))
        elif kind == "source":
            res = {"path": str(make_source(Path(rest[0]), int(rest[1]), int(rest[2])))}
        elif kind == "plan":
            res = child_plan(*rest)
        elif kind == "fold":
            res = child_fold(*rest)
        else:
            res = child_source(*rest)  # "load", PATH, FN
        print(json.dumps(res))
        return

    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str, str]] = []  # what, seconds, peak RSS, note
    try:
        stamp = work / f"build-{a.samples}.json"
        if stamp.exists() and (work / f"b{a.samples}" / "build" / "events.duckdb").exists():
            info = json.loads(stamp.read_text())
            print(f"re-using {info['build']}")
        else:
            t0 = time.perf_counter()
            info = run_child(["build", str(work / f"b{a.samples}"), str(a.samples)])[0]
            info["make_s"] = time.perf_counter() - t0
            stamp.write_text(json.dumps(info))
        build = info["build"]
        print(f"build {build}: {a.samples:,} samples, {info['events']:,} events "
              f"({info['events'] / a.samples:.2f} a sample), log {mib(info['log_bytes'])}, synthesized in "
              f"{info['synth_s']:.1f} s; states {info['states']}")

        _, startup, rss = run_cmd([*hsbuild(), "--version"])
        rows.append(("hsbuild --version (start-up)", f"{startup:.2f}", mib(rss), ""))
        run_child(["fold", build, "clear"])  # (a kept build may hold one)
        rows.append(("-- the whole log folded (no checkpoint of the fold)", "", "", ""))
        measure_log(build, a.repeat, startup, rows)
        res, wall, rss = run_child(["fold", build, "checkpoint"])
        rows.append(("-- checkpoint of the fold, as a run's end leaves it", f"{res['s']:.2f}", mib(rss),
                     f"log {mib(res['before'])} -> {mib(res['after'])}"))
        measure_log(build, a.repeat, startup, rows)
        if not a.no_reader:  # the trainer's reader over the same log (tools/bench_reader.py: items/s there)
            import bench_reader  # noqa: PLC0415

            reader_rows: list[tuple[str, str, str]] = []
            bench_reader.measure_construct(build, reader_rows)
            rows += [(what, secs, "", note) for what, secs, note in reader_rows]

        if not a.no_resume:  # a complete build of a real source: resume the long way, then with nothing to do
            import bench_resume  # noqa: PLC0415

            rows += [(what, secs, "", note) for what, secs, note in bench_resume.measure(a.samples, work, a.repeat)]
        if not a.no_source:
            t = a.source_tokens
            points = []
            for fmt in a.source_formats.split(","):
                ext = {"jsonl": "jsonl", "parquet": "parquet"}[fmt]
                for nrows, ntok in ((a.samples, t), (max(a.samples // 8, 1), t * 8)):
                    t0 = time.perf_counter()
                    path = Path(run_child(["source", str(work / f"src-{nrows}x{ntok}.{ext}"), str(nrows),
                                           str(ntok)])[0]["path"])
                    made = time.perf_counter() - t0
                    res, wall, rss = run_child(["load", str(path), "load_source"])
                    rows.append((f"load_source {fmt} {nrows:,} x ~{ntok}", f"{res['s']:.2f}", mib(rss),
                                 f"holds {mib(res['held_rss'])} after; {res['tokens']:,} tokens; file "
                                 f"{mib(path.stat().st_size)}" + (f" (written in {made:.0f} s)" if made > 1 else "")))
                    points.append((fmt, res["rows"], res["tokens"], res["held_rss"], rss - res["base_rss"]))
                    if not (ROOT / "builder" / "extract" / "source_index.py").exists():
                        continue
                    res, wall, rss = run_child(["load", str(path), "scan_source"])
                    rows.append((f"scan_source {fmt} {nrows:,} x ~{ntok}", f"{res['s']:.2f}", mib(rss),
                                 f"holds {mib(res['held_rss'])} after (streamed)"))
            for fmt in a.source_formats.split(","):
                (_, r1, t1, h1, p1), (_, r2, t2, h2, p2) = [p for p in points if p[0] == fmt]
                # held = a * rows + b * tokens, from two sizes
                det = r1 * t2 - r2 * t1
                if det:
                    per_row = (h1 * t2 - h2 * t1) / det
                    per_tok = (r1 * h2 - r2 * h1) / det
                    pk_row = (p1 * t2 - p2 * t1) / det
                    pk_tok = (r1 * p2 - r2 * p1) / det
                    n, tok = a.samples, a.samples * a.extrapolate_tokens
                    rows.append((f"  load_source {fmt}: model", "", "",
                                 f"held {per_row:.0f} B/row + {per_tok:.1f} B/token, peak {pk_row:.0f} B/row + "
                                 f"{pk_tok:.1f} B/token -> {n:,} x {a.extrapolate_tokens}: held "
                                 f"{(per_row * n + per_tok * tok) / 2**30:.1f} GiB, peak "
                                 f"{(pk_row * n + pk_tok * tok) / 2**30:.1f} GiB"))
        if a.fresh:  # a real run, asked while it writes (tools/bench_fresh.py)
            import bench_fresh  # noqa: PLC0415

            rows += [(what, "", "", value) for what, value in bench_fresh.measure_fresh(min(a.samples, 100_000))]
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    if a.verify:
        measure_verify(a.samples)
    if a.log_size:
        import bench_logsize  # noqa: PLC0415

        bench_logsize.main(["--samples", str(a.samples)])
    if a.export:
        measure_export(a.samples)

    w = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"\n{'measure':<{w[0]}}  {'seconds':>{w[1]}}  {'peak RSS':>{w[2]}}  note")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}")


if __name__ == "__main__":
    main()
