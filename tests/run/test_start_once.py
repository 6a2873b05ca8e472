"""A run's start is one preparation step (builder/run/preparation.py): from `hsbuild run BUILD` until its first worker
is handed its settings, the build's configuration is loaded once, the backend registry is asked for the backend
once, and the worker count and threads are sized once; everything after takes them from the one `Prepared` value.
(Before, the CLI sized the standby workers and the coordinator sized them again, and the threads were counted
twice: run/sizing.py entered four times, the registry asked six times, hsbuild.toml loaded twice.)

Traced with sys.setprofile, a real run of the built-in model (tools/trace_start.py prints the whole trace)."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import pytest

from builder.cli import app
from builder.config import load_config
from builder.extract.backends import registry
from builder.run import sizing
from builder.run.preparation import Prepared, RunOptions, prepare
from builder.run.standby import Standby

# the registry's lookups: what a caller asks it for a backend (a spec's own hooks are not lookups)
LOOKUPS = {f.__code__: f.__name__ for f in (registry.for_run, registry.of_config, registry.get, registry.choose,
                                            registry.importer, registry.specs, registry.names)}


def _asked_until_the_first_worker(build, monkeypatch) -> Counter:
    asked: Counter = Counter()
    started = []
    real_take = Standby.take

    def take(self, w, settings):
        started.append(w)
        return real_take(self, w, settings)

    monkeypatch.setattr(Standby, "take", take)

    def prof(frame, event, arg):
        if started or event != "call":
            return
        code, module = frame.f_code, frame.f_globals.get("__name__")
        back = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if not back.startswith(("builder.run.", "builder.cli.")):  # (the run's own questions: not the preflight's)
            return
        if code in LOOKUPS:
            asked[f"registry.{LOOKUPS[code]}"] += 1
        elif module == sizing.__name__ and back != sizing.__name__:
            asked[f"sizing.{code.co_name}"] += 1
        elif code is load_config.__code__:
            asked["config.load_config"] += 1

    args = app.build_parser().parse_args(["run", str(build), "--no-progress"])
    sys.setprofile(prof)
    try:
        code = app.cmd_run(args)
    finally:
        sys.setprofile(None)
    assert code == 0 and started
    return asked


def test_hsbuild_run_asks_the_config_the_registry_and_the_sizing_once(make_build, monkeypatch):
    build = make_build(2, seed=3, workers="auto")
    asked = _asked_until_the_first_worker(build, monkeypatch)
    assert asked == {"config.load_config": 1, "registry.for_run": 1, "sizing.size": 1}, asked


def test_the_prepared_run_is_one_value_the_run_takes_as_it_is(make_build):
    """`prepare` decides (the count `auto` stands for, each worker's threads, where they compute) and refuses
    before anything is touched; the run reads the frozen result."""
    build = make_build(2, seed=3, workers="auto")
    prep = prepare(build, RunOptions(device="cpu"))
    assert isinstance(prep, Prepared) and prep.workers >= 1 and prep.workers_why.startswith("the CPU")
    assert prep.threads == max(1, sizing.usable_cpus() // prep.workers) and prep.compute_device == "cpu"
    assert prep.standby is None  # started only when asked (the CLI)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prep.workers = 9  # type: ignore[misc]
