"""`hsbuild doctor BUILD`: the preflight checks on demand (see builder/doctor.py, docs/doctor.md)."""

from __future__ import annotations

import argparse

from builder.cli.args import size
from builder.errors import EXIT_OK, EXIT_PREFLIGHT


def add_commands(sub, out) -> None:
    p = sub.add_parser("doctor", parents=[out],
                       help="check GPUs, storage, build state and environment; works during a run",
                       description="One line per check (OK / WARN / FAIL) with the fix. Exit code 4 when a "
                                   "check FAILs (a problem that makes `run` refuse to start), else 0. It only reads "
                                   "the build (--probe, --record: it writes), and names a volume that does not "
                                   "answer within HSBUILD_STALL_S instead of waiting for it.")
    p.add_argument("build")
    p.add_argument("--device", help="check for this device instead of the config's (auto, cpu, cuda[:N])")
    p.add_argument("--gpu-mem-threshold", type=size, default=None, metavar="SIZE",
                   help="foreign GPU memory above this on a GPU the build uses is blocking (default 1G)")
    p.add_argument("--probe", dest="probe", action="store_true",
                   help="also write and fsync 4 MB in the build directory (a file removed after) to time the volume "
                        "and find writes that hang; without it doctor writes nothing to the build")
    p.add_argument("--record", dest="record", action="store_true",
                   help="record this report as a `doctor` event in the build's log (takes the build lock for a "
                        "moment, after a write probe); without it doctor writes nothing to the build")
    # the defaults since doctor writes nothing unless asked; still accepted
    p.add_argument("--no-probe", dest="probe", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--no-record", dest="record", action="store_false", help=argparse.SUPPRESS)


def cmd_doctor(args: argparse.Namespace) -> int:
    from builder.cli.output import print_json, print_rows  # noqa: PLC0415
    from builder.doctor.checks import GPU_MEM_THRESHOLD  # noqa: PLC0415
    from builder.doctor.report import render_lines, run_doctor  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415

    threshold = GPU_MEM_THRESHOLD if args.gpu_mem_threshold is None else args.gpu_mem_threshold
    report = run_doctor(layout(args.build), device=args.device, record=args.record, probe=args.probe,
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
