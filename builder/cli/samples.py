"""`hsbuild skip`: retire samples that can never succeed, so a run can end with exit 0 (`--undo` brings them back).

Exit codes: 0 recorded; 2 usage error (an unknown id, no reason; nothing recorded).
"""

from __future__ import annotations

import argparse
import shlex

from builder.cli.args import fmt_of as _fmt
from builder.cli.output import print_json
from builder.errors import EXIT_OK


def add_commands(sub, out) -> None:
    p = sub.add_parser("skip", parents=[out], help="retire samples that can never succeed (kept in the log, with why)",
                       description="Records a `retired` event (reason skipped, your note) for each ID: the sample "
                                   "leaves the totals, the reader and exports, and runs no longer try it, so a "
                                   "run can end with exit 0. Its events stay in the log: SELECT sample_id, "
                                   "retired_note FROM samples WHERE state = 'retired'; a write-once record under "
                                   "data/history/ keeps them for a rebuilt log (`hsbuild rebuild-log`). --undo "
                                   "makes skipped samples pending again (recorded the same way).")
    p.add_argument("build")
    p.add_argument("ids", nargs="+", metavar="ID", help="sample ids (the source's `id` field)")
    p.add_argument("--reason", default="", help="why they are skipped (required unless --undo; kept in the log)")
    p.add_argument("--undo", action="store_true", help="bring skipped samples back: pending, tried by the next run")


def cmd_skip(args: argparse.Namespace) -> int:
    from builder.run.source_changes import skip_samples  # noqa: PLC0415

    rep = skip_samples(args.build, args.ids, args.reason, undo=args.undo)
    if _fmt(args) == "json":
        print_json({"undo": args.undo, "changed": rep.changed, "unchanged": rep.unchanged})
        return EXIT_OK
    b = shlex.quote(args.build)
    if args.undo:
        print(f"brought back {len(rep.changed)} sample(s)" + (f": {', '.join(rep.changed)}" if rep.changed else "")
              + (f"; {len(rep.unchanged)} were not skipped" if rep.unchanged else "")
              + (f"; the next `hsbuild resume {b}` extracts them" if rep.changed else ""))
    else:
        print(f"skipped {len(rep.changed)} sample(s)" + (f": {', '.join(rep.changed)}" if rep.changed else "")
              + (f"; {len(rep.unchanged)} already retired" if rep.unchanged else "")
              + f"; undo with: hsbuild skip {b} ID... --undo")
    return EXIT_OK


COMMANDS = {"skip": cmd_skip}
