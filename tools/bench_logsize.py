"""What a sample costs in the event log, measured on a real build.

    python tools/bench_logsize.py --samples 100000              # init + a run (2 workers) + a full verify
    python tools/bench_logsize.py --build BUILD                 # measure an existing build's log as it is

A build of --samples tiny samples (8-32 tokens, built-in model hidden 64) is made with `hsbuild init` and
`hsbuild run --workers 2`; its log is measured after the run and again after `hsbuild verify` (a full sweep).
DuckDB's own accounting: the file's size, its blocks in use and free (`pragma_database_size`), and each part
of it as a table of its own: its rows copied into a fresh database file (the same DuckDB, the same
compression), checkpointed, less an empty one's size; a `written` event's checksums also as the JSON text they
stand for (what the log stored before they were stored compact: builder/log/checksums.py). A tiny build's log (the 4-sample baseline, measured in the
same run) is what every build pays; per-sample figures are over the difference.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
# each part of the log: (name, SQL of its rows) over the attached log `l`
PARTS = (
    ("`written` events", "SELECT * FROM l.events WHERE kind = 'written'"),
    ("  ... their checksums", "SELECT checksums FROM l.events WHERE kind = 'written'"),
    ("  ... the same as JSON text", "SELECT checksums_text(checksums) FROM l.events WHERE kind = 'written'"),
    ("  ... their detail", "SELECT detail FROM l.events WHERE kind = 'written'"),
    ("`started` events", "SELECT * FROM l.events WHERE kind = 'started'"),
    ("`verified` events", "SELECT * FROM l.events WHERE kind = 'verified'"),
    ("other events", "SELECT * FROM l.events WHERE kind NOT IN ('written', 'started', 'verified')"),
    ("the fold's checkpoint", "SELECT * FROM l.fold_checkpoint"),
    ("  ... its m_checksums", "SELECT m_checksums FROM l.fold_checkpoint"),
    ("  ... the same as JSON text", "SELECT checksums_text(m_checksums) FROM l.fold_checkpoint"),
    ("  ... its m_detail", "SELECT m_detail FROM l.fold_checkpoint"),
    ("the registered source samples", "SELECT * FROM l.source_samples"),
)


INDEX = "the unique index on `seq`"


def hsbuild(*args: str) -> str:
    cp = subprocess.run([sys.executable, "-m", "builder.cli", *args], capture_output=True, text=True)
    if cp.returncode not in (0,):
        raise RuntimeError(f"hsbuild {' '.join(args[:2])}: exit {cp.returncode}: {cp.stderr[-2000:]}")
    return cp.stdout


def make_source(path: Path, n: int) -> Path:
    rnd = random.Random(5)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rnd.randint(3, 1000) for _ in range(rnd.randint(8, 32))]}) + "\n")
    return path


def measure(build: Path) -> dict:
    """The log's size, its blocks used and free, and each part as a table of its own (bytes)."""
    import duckdb  # noqa: PLC0415

    from builder.log.checksums import checksums_macro  # noqa: PLC0415

    events = build / "events.duckdb"
    out = {"file": events.stat().st_size}
    con = duckdb.connect(str(events), read_only=True)
    try:
        size = con.execute("SELECT block_size, used_blocks, free_blocks FROM pragma_database_size()").fetchone()
        out["used"], out["free"] = size[0] * size[1], size[0] * size[2]
        out["samples"] = con.execute("SELECT count(*) FROM source_samples").fetchone()[0]
    finally:
        con.close()
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.duckdb"
        c = duckdb.connect(str(empty))
        c.execute("CREATE TABLE t (x INTEGER)")
        c.execute("CHECKPOINT")
        c.close()
        base = empty.stat().st_size
        for name, sql in PARTS:
            part = Path(tmp) / "part.duckdb"
            c = duckdb.connect(str(part))
            try:
                c.execute(checksums_macro(temp=True))  # (the text the stored checksums stand for)
                c.execute(f"ATTACH '{events}' AS l (READ_ONLY)")
                c.execute(f"CREATE TABLE t AS {sql}")
                c.execute("DETACH l")
                c.execute("CHECKPOINT")
            finally:
                c.close()
            out[name] = part.stat().st_size - base
            part.unlink()
        sizes = []  # the unique index on seq: the events' seq column with it, less without it
        for index in (False, True):
            part = Path(tmp) / "part.duckdb"
            c = duckdb.connect(str(part))
            try:
                c.execute(f"ATTACH '{events}' AS l (READ_ONLY)")
                c.execute("CREATE TABLE t AS SELECT seq FROM l.events")
                c.execute("DETACH l")
                if index:
                    c.execute("CREATE UNIQUE INDEX t_seq ON t (seq)")
                c.execute("CHECKPOINT")
            finally:
                c.close()
            sizes.append(part.stat().st_size)
            part.unlink()
        out[INDEX] = sizes[1] - sizes[0]
    return out


def show(label: str, m: dict, base: dict | None) -> None:
    n = m["samples"] - (base["samples"] if base else 0)
    fixed = base or {k: 0 for k in m}
    print(f"\n{label}: {m['samples']:,} samples; file {m['file'] / 1e6:.1f} MB")
    print(f"  file {(m['file'] - fixed['file']) / n:.0f} B a sample beyond the tiny build's {fixed['file'] / 1e6:.1f} MB"
          f"; blocks in use {(m['used'] - fixed['used']) / n:.0f} B, free {(m['free'] - fixed['free']) / n:.0f} B")
    for name in [p[0] for p in PARTS] + [INDEX]:
        print(f"  {name:<34} {m[name] / m['samples']:6.1f} B a sample")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--build", type=Path, help="measure this build's log as it is (nothing made)")
    ap.add_argument("--keep", type=Path, help="make the builds here, and keep them")
    ap.add_argument("--no-verify", action="store_true")
    a = ap.parse_args(argv)
    if a.build:
        show(str(a.build), measure(a.build), None)
        return
    work = a.keep or Path(tempfile.mkdtemp(prefix="bench-logsize-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = {}
        for name, n in (("tiny", 4), ("big", a.samples)):
            b = work / name
            if b.exists():
                shutil.rmtree(b)
            hsbuild("init", str(b), "--source", str(make_source(work / f"{name}.jsonl", n)), "--model", MODEL)
            hsbuild("run", str(b), "--no-progress", "--workers", "2")
            results[name, "run"] = measure(b)
            if not a.no_verify:
                hsbuild("verify", str(b), "--no-progress")
                results[name, "verify"] = measure(b)
        show("after the run", results["big", "run"], results["tiny", "run"])
        if not a.no_verify:
            show("after a full verify", results["big", "verify"], results["tiny", "verify"])
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
