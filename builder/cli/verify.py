"""`hsbuild verify` and `hsbuild gc`: render the sweep's and gc's typed findings, name the repair command.

Exit codes: 0 every selected sample was checked and is good (orphans alone are not damage); 1 damage found, or
some samples could not be checked (EMFILE, EIO, ...: nothing was condemned, retry); 2 usage error; 130
interrupted (continue with `hsbuild verify BUILD --continue`).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from builder.cli.args import fmt_of as _fmt
from builder.cli.output import print_json, print_rows
from builder.cli.progress import progress_for
from builder.errors import EXIT_INTERRUPTED, EXIT_OK
from builder.humanize import human_bytes

TAKE_OVER_HELP = ("take the build over from an owner on another host that never released it (make sure it no "
                  "longer runs there first)")


def add_commands(sub, out) -> None:
    p = sub.add_parser("verify", parents=[out],
                       help="read samples back and check their checksums; report damage and reclaimable bytes")
    p.add_argument("build")
    p.add_argument("--quick", action="store_true",
                   help="structural check only: files present with plausible sizes, no overlaps (reads no data)")
    p.add_argument("--subset", metavar="n/t", help="check the n-th of t fixed parts (t sweeps 1/t..t/t cover all)")
    p.add_argument("--fraction", metavar="F", help="check a random fraction F of the samples (0 < F <= 1)")
    p.add_argument("--seed", help="seed for --fraction (default: random, recorded)")
    p.add_argument("--not-verified-since", metavar="TIME",
                   help="only samples not verified since TIME (ISO timestamp, UTC), e.g. 2025-05-01T12:00:00Z")
    p.add_argument("--segment", action="append", metavar="S", help="only samples stored in segment S (repeatable)")
    p.add_argument("--max-rate", metavar="MB/s", help="read at most this many MB (10^6 bytes) of chunk files a second")
    p.add_argument("--jobs", metavar="N", help="parallel readers (default: 1 for a full sweep of samples averaging "
                   "under 32 kB compressed, else min(4, CPUs))")
    p.add_argument("--continue", dest="resume", action="store_true",
                   help="continue the last interrupted sweep, skipping what it already checked")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--take-over", action="store_true", help=TAKE_OVER_HELP)

    p = sub.add_parser("gc", parents=[out], help="remove orphaned bytes (crashed writers' leftovers); durable "
                                                 "work the log missed is kept for `hsbuild resume` to adopt")
    p.add_argument("build")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--take-over", action="store_true", help=TAKE_OVER_HELP)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def repair_lines(build: str, summary) -> list[str]:
    """The exact commands that repair what a sweep found."""
    b = shlex.quote(build)
    lines = []
    if summary.damaged:
        lines.append(f"repair: hsbuild resume {b}   (re-extracts the {len(summary.damaged)} damaged sample(s) "
                     "into new segments)")
        if summary.mode == "quick":
            lines.append(f"then:   hsbuild verify {b}   (a full read: --quick cannot see flipped bits)")
        else:
            since = summary.started_at.isoformat() + "Z"
            lines.append(f"then:   hsbuild verify {b} --not-verified-since {since}   (checks them, and everything "
                         "this sweep did not verify)")
    for o in summary.overlaps:
        lines.append(f"overlap: read segment {o.segment} back to see which sample owns the bytes: "
                     f"hsbuild verify {b} --segment {o.segment}, then hsbuild resume {b}")
    if summary.not_checked:
        again = (f"hsbuild verify {b} --quick" if summary.mode == "quick" else
                 f"hsbuild verify {b} --not-verified-since {summary.started_at.isoformat()}Z")
        lines.append(f"retry:  {again}   (could not check {len(summary.not_checked)} sample(s); they are not "
                     "marked failed: free descriptors/memory or fix the I/O error, or lower --jobs)")
    return lines


def cmd_verify(args: argparse.Namespace) -> int:
    from builder.verify.sweep import SweepOptions, run_sweep  # noqa: PLC0415

    opts = SweepOptions(quick=args.quick, subset=args.subset, fraction=args.fraction, seed=args.seed,
                        not_verified_since=args.not_verified_since, segments=args.segment, max_rate=args.max_rate,
                        jobs=args.jobs, resume=args.resume, progress=progress_for(args), take_over=args.take_over)
    s = run_sweep(args.build, opts, echo=_err)
    fmt = _fmt(args)
    if fmt == "json":
        print_json({**s.as_dict(), "exit_code": s.exit_code, "repair": repair_lines(args.build, s)})
        return s.exit_code
    if fmt == "csv":
        print_rows(["sample_id", "reason", "message", "segment", "token_start", "num_tokens"],
                   [[d.sample_id, d.reason, d.message, d.segment, d.token_start, d.num_tokens]
                    for d in [*s.damaged, *s.not_checked]], "csv")
        return s.exit_code
    print("\n".join(summary_lines(args.build, s)))
    return s.exit_code


def summary_lines(build: str, s) -> list[str]:
    b = shlex.quote(build)
    head = f"verify {s.sweep_id[:8]} ({s.selection.describe()})"
    if s.continues:
        head += f", continuing {s.continues[:8]}: {s.skipped} already checked"
    lines = [head + f": {s.checked} of {s.selected - s.skipped} sample(s) checked"]
    lines.append(f"  ok {s.ok} | mismatched {s.mismatched} | missing {s.missing} | unreadable {s.unreadable}"
                 + (f" | overlapping {len(s.overlaps)}" if s.overlaps else "")
                 + (f" | not checked {s.check_errors}" if s.check_errors else ""))
    if s.mode == "full":
        lines.append(f"  read {human_bytes(s.bytes_read)} ({human_bytes(s.raw_bytes)} uncompressed) in "
                     f"{s.seconds:.1f}s: {s.mb_per_s:.1f} MB/s")
    for d in s.damaged:
        lines.append(f"DAMAGED {d.sample_id}: {d.reason}: {d.message} "
                     f"[{d.segment} tokens {d.token_start}+{d.num_tokens}]")
    for n in s.not_checked:
        lines.append(f"NOT CHECKED {n.sample_id}: {n.message} [{n.segment} tokens {n.token_start}+{n.num_tokens}]")
    for o in s.overlaps:
        lines.append(f"OVERLAP {o.first} and {o.second} share chunks in {o.segment} "
                     f"({o.first_chunks[0]}-{o.first_chunks[1]} / {o.second_chunks[0]}-{o.second_chunks[1]})")
    r = s.orphans
    if r.count:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(r.by_kind().items()))
        lines.append(f"reclaimable: {r.count} orphan(s) ({kinds}; {r.files} file(s)), {human_bytes(r.nbytes)}; "
                     f"not damage. Remove with: hsbuild gc {b}")
    if s.outcome == "interrupted":
        lines.append(f"interrupted: what was checked is recorded; continue with: hsbuild verify {b} --continue")
    elif s.not_checked:
        lines.append(f"could not check {len(s.not_checked)} sample(s) (I/O or resource errors, not their data): "
                     "nothing was marked failed; retry with the command below")
    elif not s.damage_found:
        lines.append("all checked samples are good" if s.checked else "nothing to check")
    lines.extend(repair_lines(build, s))
    return lines


def cmd_gc(args: argparse.Namespace) -> int:
    from builder.verify.gc import collect_garbage  # noqa: PLC0415

    rep = collect_garbage(args.build, dry_run=args.dry_run, take_over=args.take_over)
    if rep.record_error:
        _err(f"hsbuild gc: warning: {rep.record_error} (the removal itself is done)")
    fmt = _fmt(args)
    if fmt == "json":
        print_json(rep.as_dict())
        return EXIT_OK
    items = rep.orphans.orphans
    b = shlex.quote(args.build)
    if fmt == "csv":
        print_rows(["path", "kind", "bytes", "files"], [[o.path, o.kind, o.nbytes, o.files] for o in items], "csv")
        return EXIT_OK
    if args.dry_run:
        for o in items:
            print(f"would remove {o.kind:8} {human_bytes(o.nbytes):>9}  {o.path}"
                  + (f" ({o.files} files)" if o.kind == "segment" else ""))
        if items:
            print(f"dry run: {len(items)} orphan(s), {rep.orphans.files} file(s), {human_bytes(rep.orphans.nbytes)} "
                  f"reclaimable; remove with: hsbuild gc {b}")
        else:
            print("dry run: nothing to remove (no orphaned bytes)")
    elif items:
        print(f"gc: removed {len(items)} orphan(s), {rep.removed_files} file(s), freed "
              f"{human_bytes(rep.removed_bytes)}")
    else:
        print("gc: nothing to remove; freed 0 B")
    kept = rep.orphans.adoptable
    if kept:
        print(f"gc: kept {rep.orphans.adoptable_samples} durable sample(s) in {len(kept)} group(s) "
              f"({human_bytes(sum(a.nbytes for a in kept))}) that the log does not list yet (a crash, a full disk "
              f"or a lost WAL before their events committed): not orphans; adopt them with: hsbuild resume {b}")
    return EXIT_OK


COMMANDS = {"verify": cmd_verify, "gc": cmd_gc}

__all__ = ["add_commands", "COMMANDS", "EXIT_INTERRUPTED"]
