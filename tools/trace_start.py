"""The stops a run's start makes, from `hsbuild run BUILD` (its arguments parsed; or `run_build(BUILD)`) until its
first worker is handed its settings: every call that hsbuild's run or CLI code (builder/run/, builder/cli/) makes
into a function or class of another module of builder/, at any depth, traced with sys.setprofile (a method of an
object the run already holds is not a stop: the run uses what it was handed). Consecutive calls into one module are
one stop. Prints the stops in order, how many in how many modules, the modules entered more than once, the stops
that go back up the layers (into a module of a higher layer than the stop before), and the questions put to the
build's configuration, the backend registry and the sizing (ASKED).

    python tools/trace_start.py [--library] [--samples N]

A fresh 4-sample build of the built-in model in a temporary folder, `workers = auto`. Module-level imports done
before the trace starts (the CLI's and the coordinator's), so only calls count."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

LAYERS = [
    {"errors", "humanize", "progress", "mounts", "procfs", "fsutil", "subset", "layout", "config"},
    {"log", "store", "formats"},
    {"extract", "space"},
    {"reader"},
    {"verify", "doctor", "exchange"},
    {"run"},
    {"cli"},
]


ASKED = ("builder.config", "builder.extract.backends.registry", "builder.run.sizing")


def layer(module: str) -> int:
    unit = module.split(".")[1] if module.count(".") else module
    return next((i for i, units in enumerate(LAYERS) if unit in units), -1)


def trace(build: Path, library: bool) -> list[tuple[str, str]]:
    """(module, function) of each call counted, in order."""
    import builder.cli.app as app  # noqa: F401 - (imported before the trace: only calls count)
    import builder.run.coordinator  # noqa: F401
    from builder.run import standby

    calls: list[tuple[str, str]] = []
    done = [False]
    real_take = standby.Standby.take

    def take(self, w, settings):  # noqa: ANN001, ANN202 - the first worker handed its settings: the run has started
        done[0] = True
        return real_take(self, w, settings)

    standby.Standby.take = take

    def prof(frame, event, arg):  # noqa: ANN001, ANN202, ARG001
        if done[0] or event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        code = frame.f_code
        if (callee.startswith("builder.") and callee != caller and caller.startswith(("builder.run.", "builder.cli."))
                and (code.co_name == "__init__" or "." not in code.co_qualname)):
            calls.append((callee, code.co_name))

    args = app.build_parser().parse_args(["run", str(build), "--no-progress"])  # (parsed before the trace)
    sys.setprofile(prof)
    try:
        if library:
            from builder.run.coordinator import run_build

            run_build(build)
        else:
            app.cmd_run(args)
    finally:
        sys.setprofile(None)
        standby.Standby.take = real_take
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", action="store_true", help="from run_build(BUILD), not from `hsbuild run BUILD`")
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    from builder.extract.demo import write_demo_source
    from builder.run.create import init_build

    with tempfile.TemporaryDirectory() as tmp:
        src = write_demo_source(Path(tmp) / "source.jsonl", n=args.samples)
        build = Path(tmp) / "build"
        init_build(build, src, model="builtin")
        calls = trace(build, args.library)
    stops: list[tuple[str, list[str]]] = []
    for module, fn in calls:
        if stops and stops[-1][0] == module:
            if fn not in stops[-1][1]:
                stops[-1][1].append(fn)
        else:
            stops.append((module, [fn]))
    up = [b for a, b in zip(stops, stops[1:], strict=False) if layer(b[0]) > layer(a[0])]
    for module, fns in stops:
        print(f"  {module}: {', '.join(fns)}")
    entered = Counter(m for m, _ in stops)
    print(f"{len(stops)} stops in {len(entered)} modules, {len(up)} of them back up the layers")
    print("entered more than once:", ", ".join(f"{m} {n}" for m, n in entered.most_common() if n > 1) or "none")
    for module in ASKED:
        print(f"{module}: {entered.get(module, 0)} stop(s):",
              ", ".join(f for m, fns in stops if m == module for f in fns) or "-")


if __name__ == "__main__":
    main()
