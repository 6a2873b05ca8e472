"""`hsbuild rebuild-log`: a lost or damaged event log rebuilt from the data and the build's history records
(docs/design.md section 11).

Exit codes: 0 rebuilt, every restored sample read back good; 1 rebuilt, but some restored samples were damaged
(recorded failed: `hsbuild resume` extracts them again) or could not be read (left written, not checked);
2 usage error (no config, a damaged history record; nothing changed); 5 busy.
"""

from __future__ import annotations

import argparse
import shlex

from builder.cli.args import positive_int
from builder.errors import EXIT_OK, EXIT_SAMPLES_FAILED

NOT_RESTORED = ("not restored (the lost log alone held them): a run's failures (such samples come back pending "
                "and are tried again), attempt counts, verifications by --verify-after-write or by adoption (those "
                "samples come back written: read back just now), samples removed from the source")


def add_commands(sub, out) -> None:  # noqa: ARG001 - (no --json yet)
    p = sub.add_parser("rebuild-log", help="rebuild a lost or damaged event log from the data and its history",
                       description="Rebuilds events.duckdb from hsbuild.toml, the source, every segment's "
                                   "manifests and the build's history records (data/history/: runs, skips, verify "
                                   "verdicts, dropped responses), replayed in the order they were written; the old log is kept, "
                                   "renamed. Every sample it restores as written is read back against its "
                                   "checksums first (a full read of the build's data: the price of never serving "
                                   "wrong bytes); a damaged one is recorded failed and `hsbuild resume` extracts "
                                   "it again. Exit 1 when some were damaged or could not be read.")
    p.add_argument("build")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel readers (default: up to 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_rebuild_log(args: argparse.Namespace) -> int:
    from builder.cli.progress import progress_for  # noqa: PLC0415
    from builder.extract.build_meta import recorded_meta, source_samples  # noqa: PLC0415
    from builder.humanize import human_bytes  # noqa: PLC0415
    from builder.run.rebuild import rebuild_log  # noqa: PLC0415

    rep = rebuild_log(args.build, recorded_meta, source_samples, progress_for(args), args.jobs)
    h = rep.history
    b = shlex.quote(args.build)
    if rep.kept_as:
        print(f"kept the old log as {rep.kept_as}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(h.records.items()))
    print(f"rebuilt the log from {rep.segments} segment(s) and {sum(h.records.values())} history record(s)"
          + (f" ({kinds})" if kinds else "")
          + (f"; {h.foreign} manifest entr(ies) not in the source left out" if h.foreign else "")
          + (f"; {rep.layout1_segments} segment(s) predate manifests (their samples are extracted again)"
             if rep.layout1_segments else ""))

    def named(pairs: list[tuple[str, str]]) -> str:
        return ", ".join(f"{sid} ({why})" for sid, why in pairs[:5]) + (f", ... (+{len(pairs) - 5})"
                                                                        if len(pairs) > 5 else "")

    print(f"read back {h.read_back} sample(s) ({human_bytes(h.read_bytes)}) against their checksums: {h.good} good"
          + (f"; {len(h.damaged)} damaged, recorded failed, extracted again by resume: {named(h.damaged)}"
             if h.damaged else "")
          + (f"; {len(h.not_checked)} could not be read (left written, not checked: run `hsbuild verify {b}` "
             f"once the storage answers): {named(h.not_checked)}" if h.not_checked else ""))
    print(f"restored: {h.written} of {rep.registered} sample(s) written ({h.verified} verified by a sweep's "
          f"record), {h.skipped} skipped"
          + (f", {h.dropped} dropped at the token limit (--drop-truncated)" if h.dropped else "") + (f", {h.failed} failed (damaged data)" if h.failed else "")
          + f"; {rep.pending} pending (no durable data)")
    print(NOT_RESTORED)
    todo = rep.pending + h.failed
    print(f"next: hsbuild resume {b}   (extracts the {todo} sample(s) pending or failed)" if todo else
          "next: nothing to extract; hsbuild status " + b)
    return EXIT_SAMPLES_FAILED if h.damaged or h.not_checked else EXIT_OK


COMMANDS = {"rebuild-log": cmd_rebuild_log}
