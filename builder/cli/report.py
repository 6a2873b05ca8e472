"""`hsbuild report BUILD [-o FILE] [--json]`: the build's history as one self-contained HTML page (README.md,
"The report page").

Exit codes: 0 written; 2 usage (not a build, a read-only build without -o, matplotlib missing: the `report` extra);
3 no room to write the page."""

from __future__ import annotations

import argparse

from builder.cli.output import print_json
from builder.errors import EXIT_OK


def add_commands(sub, out) -> None:  # noqa: ANN001 - argparse's subparsers and the --json/--csv parent
    p = sub.add_parser("report", help="the build's history as one HTML page (charts inline; works during a run)",
                       description="Draws the build's history from its event log alone: throughput with runs, "
                                   "pauses, stalls and interruptions marked; samples by state and the time left; "
                                   "lengths; failures; bytes on disk; verification; per worker and node. One HTML "
                                   "file that opens offline. Reads the log as `status` does (through a live run's "
                                   "owner); writes only the page. Needs matplotlib: pip install 'hsbuild[report]'.")
    p.add_argument("build")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write the page (default BUILD/report.html)")
    p.add_argument("--json", action="store_true", help="also print every figure's series as JSON on stdout")


def cmd_report(args: argparse.Namespace) -> int:
    from builder.layout import layout  # noqa: PLC0415
    from builder.report.page import make_report  # noqa: PLC0415
    from builder.space.probe import require_answering  # noqa: PLC0415

    lay = layout(args.build)
    require_answering(lay)  # a volume that does not answer: one line within HSBUILD_STALL_S, not a hang
    lay.require()
    path, series = make_report(lay, args.output)
    if args.json:
        print_json({"report": str(path), **series})
    else:
        print(f"wrote {path}")
    return EXIT_OK


COMMANDS = {"report": cmd_report}
