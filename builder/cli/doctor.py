"""`hsbuild doctor BUILD`: the preflight checks on demand (see builder/doctor.py, docs/doctor.md)."""

from __future__ import annotations

import argparse

from builder.cli.args import size
from builder.errors import EXIT_OK, EXIT_PREFLIGHT


def add_commands(sub, out) -> None:
    p = sub.add_parser("doctor", parents=[out],
                       help="check GPUs, storage, build state and environment; works during a run",
                       description="One line per check (OK / WARN / FAIL) with the fix. Exit code 4 when a "
                                   "check FAILs (a problem that makes `run` refuse to start), else 0.")
    p.add_argument("build")
    p.add_argument("--device", help="check for this device instead of the config's (auto, cpu, cuda[:N])")
    p.add_argument("--gpu-mem-threshold", type=size, default=None, metavar="SIZE",
                   help="foreign GPU memory above this on a GPU the build uses is blocking (default 1G)")
    p.add_argument("--no-probe", action="store_true", help="skip the write-and-fsync probe of the build directory")
    p.add_argument("--no-record", action="store_true", help="do not record a `doctor` event in the build")


def cmd_doctor(args: argparse.Namespace) -> int:
    from builder.cli.output import print_json, print_rows  # noqa: PLC0415
    from builder.doctor.checks import GPU_MEM_THRESHOLD  # noqa: PLC0415
    from builder.doctor.report import render_lines, run_doctor  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415

    threshold = GPU_MEM_THRESHOLD if args.gpu_mem_threshold is None else args.gpu_mem_threshold
    report = run_doctor(layout(args.build), device=args.device, record=not args.no_record, probe=not args.no_probe,
                        gpu_mem_threshold=threshold)
    if getattr(args, "json", False):
        print_json(report.as_dict())
    elif getattr(args, "csv", False):
        print_rows(["name", "status", "summary", "fix"],
                   [[c.name, c.status.upper(), c.summary, c.fix] for c in report.checks], "csv")
    else:
        print("\n".join(render_lines(report)))
    return EXIT_PREFLIGHT if report.problems else EXIT_OK


COMMANDS = {"doctor": cmd_doctor}
