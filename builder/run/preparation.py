"""A run's start, decided once.

`prepare(build, opts)` checks what the caller asked (`RunOptions`) against the build and resolves it into one
frozen value, `Prepared`, which the run (builder/run/coordinator.py) takes as it is: hsbuild.toml with this run's
overrides, the backend the run drives (asked of the registry once: builder/extract/backends/registry.py), how many
workers and how many intra-op threads each (asked of builder/run/sizing.py once), the device they are told and
the one they compute on, whether an inference server runs the model (and whether this run launches it), whether
their model is a Hugging Face directory to preload while they wait, the stop grace, and an import's dump claim.
Nothing later in the run asks any of these again.

Nothing here takes the build lock, opens the log or touches the build: a refusal changes nothing. The one thing
it may start is the standby workers (builder/run/standby.py), when its caller asks (the CLI, so that the workers'
imports overlap the coordinator's own): they are then started with the count decided here, not sized again.
Cheap to import (no torch, no doctor): the CLI imports it before it starts the standby workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import AUTO_WORKERS, BuildConfig, is_count, load_config
from builder.errors import UsageError
from builder.extract.backends import registry as backends
from builder.extract.spec import check_device_spec
from builder.layout import BuildLayout, layout
from builder.run import sizing, testhook
from builder.run.standby import Standby, loads_hf_model

if TYPE_CHECKING:  # (these import torch: only an import needs them, and imports them there)
    from builder.exchange.imports import ImportOptions
    from builder.progress import Progress

STOP_GRACE_SECONDS = 30.0  # after Ctrl-C/SIGTERM, how long workers get to finish their sample (HSBUILD_STOP_GRACE)
RAY_CPUS_PER_WORKER = float(os.environ.get("HSBUILD_RAY_CPUS", "1"))  # CPUs a Ray worker's actor reserves
STANDBY_MAX = 256  # the most workers the CLI starts before the run (a larger count is started by the run)


@dataclass
class RunOptions:
    workers: int | str | None = None  # a count, or "auto" (builder/run/sizing.py); None: the config's
    limit: int | None = None
    max_attempts: int | None = None
    device: str | None = None
    verify_after_write: bool | None = None
    allow_overcommit: bool = False
    force: bool = False
    progress: Progress | None = None  # where progress is reported (the CLI draws a bar); None: nowhere
    low: float | None = None
    high: float | None = None
    flood: float | None = None
    min_free: int | None = None
    # after Ctrl-C/SIGTERM, seconds the workers get to finish the sample in hand before they are killed (named,
    # their sample left for resume); None: $HSBUILD_STOP_GRACE, else 30
    stop_grace: float | None = None
    take_over: bool = False  # take the lock over from an owner on another host (--take-over)
    launch: bool = False  # engine backends: start the server as a child (`serve-command`), stop it at the end
    trust_server: bool = False  # engine backends: a server whose configuration cannot be read is judged by its
    # answers alone (recorded in engine_probe; status shows it)
    inflight: int | None = None  # engine backends: requests in flight (overrides hsbuild.toml)
    imports: ImportOptions | None = None  # `hsbuild import`: states from a dump's files, not forward passes
    source: str | None = None  # the build's source moved here (--source): recorded, hsbuild.toml updated
    accept_source_changes: bool = False  # record changed/removed source rows instead of refusing them
    ray: str | None = None  # workers as actors on this Ray cluster ('auto' or host:port); None: local processes
    # local workers already spawned with this run's count; the run owns and closes them (one of another count is
    # closed). None: the run spawns its own as soon as it holds the lock
    standby: Standby | None = None
    metrics: str | None = None  # serve Prometheus metrics at this host:port while the run lasts (--metrics)


@dataclass(frozen=True)
class Prepared:
    """What a run's start decided (see the module's docstring): the run reads it, never asks again."""

    opts: RunOptions  # what the caller asked (the run reads its plain flags: limit, force, launch, ...)
    lay: BuildLayout
    cfg: BuildConfig  # hsbuild.toml with this run's overrides (max_attempts, watermarks, inflight, ...)
    backend: backends.BackendSpec  # the backend this run drives: the importer for an import
    workers: int  # 0: --ray with `auto` and no server: one a live node, counted once connected to the cluster
    workers_why: str | None  # what `auto` sized the count from (said, and recorded in run_started)
    threads: int  # each worker's intra-op threads (recorded in run_started)
    device: str  # what the workers are told: --device, else the config's
    compute_device: str  # where they compute: the backend's device (a server's GPUs are the server's), else that
    stop_grace: float  # seconds the workers get to finish their sample after a stop request
    preload_hf: bool  # their model is a Hugging Face directory: its classes are imported while they wait
    dump_claim: object | None = None  # an import: the layers the dump holds, checked against the build's
    standby: Standby | None = None  # local workers started ahead, with `workers` (the run owns and closes them)

    @property
    def importing(self) -> bool:
        return self.opts.imports is not None

    def moved_to(self, source: Path) -> Prepared:
        """The same run, its source at `source` (--source: recorded, and hsbuild.toml updated, by the run)."""
        return replace(self, cfg=replace(self.cfg, source=str(source)))


def prepare(build: str | Path, opts: RunOptions | None = None, start_workers: bool = False) -> Prepared:
    """Check and resolve a run's options against the build (see the module's docstring); UsageError (and the
    like) for a bad one, before anything is touched. `start_workers`: start the standby workers too."""
    opts = opts or RunOptions()
    testhook.check_environment()  # (the test suite's hook: a malformed value is refused before anything starts)
    lay = layout(build).require()
    cfg = load_config(lay)
    importing = opts.imports is not None
    backend = backends.for_run(cfg, importing, lay.config)  # the importer for an import
    if opts.max_attempts is not None:
        if opts.max_attempts < 1:
            raise UsageError("--max-attempts: must be at least 1")
        cfg.max_attempts = opts.max_attempts
    if opts.verify_after_write is not None:
        cfg.verify_after_write = opts.verify_after_write
    for k in ("low", "high", "flood", "min_free"):
        v = getattr(opts, k)
        if v is not None:
            setattr(cfg.watermarks, k, v)
    cfg.watermarks.validate()
    device = opts.device or cfg.device
    compute_device = backend.device or device
    spec = cfg.workers if opts.workers is None else opts.workers
    if spec == AUTO_WORKERS and opts.ray and not backend.server and not importing:
        workers, why = 0, None  # one a node of the cluster, counted once connected (`Workers.size_on_cluster`)
    elif spec != AUTO_WORKERS and not is_count(spec):
        raise UsageError(f"--workers {spec}: must be auto or at least 1")
    else:
        count = sizing.size(backend, cfg, spec, compute_device)
        workers, why, threads = count.workers, count.why, count.threads
    if opts.ray:
        threads = max(1, int(RAY_CPUS_PER_WORKER))  # a Ray worker gets the CPUs its actor reserves
    grace = stop_grace(opts.stop_grace)
    if opts.limit is not None and opts.limit < 0:
        raise UsageError(f"--limit {opts.limit}: must be 0 or more samples")
    check_device_spec(device)
    if opts.ray is not None:
        _check_ray(opts, cfg, backend)
    if opts.inflight is not None:
        if opts.inflight < 1:
            raise UsageError(f"--inflight {opts.inflight}: must be at least 1")
        cfg.inflight = opts.inflight
    dump_claim = None
    if importing:
        from builder.exchange.imports import check_dump, check_options  # noqa: PLC0415 - (torch: imports only)

        check_options(opts.imports)
        if cfg.regenerate:
            raise UsageError(f"{lay.root} is a regenerating build (its responses are generated, "
                             "docs/regenerate.md); import a dump into a build made without --regenerate")
        if opts.launch:
            raise UsageError("--launch: an import reads a dump's files; it needs no server")
        dump_claim = check_dump(opts.imports, lay)  # refused here: nothing touched yet
    if opts.launch and not backend.server:
        raise UsageError(f"--launch: this build's backend is {backend.name} ({backend.summary}); --launch starts an "
                         "inference server for builds made with --backend " + " or ".join(backends.with_server()))
    preload_hf = loads_hf_model(cfg, backend)
    standby = opts.standby
    if standby is not None and (opts.ray or standby.workers != workers):
        standby.close()  # not this run's count: the run starts its own
        standby = None
    prep = Prepared(opts=opts, lay=lay, cfg=cfg, backend=backend, workers=workers, workers_why=why, threads=threads,
                    device=device, compute_device=compute_device, stop_grace=grace, preload_hf=preload_hf,
                    dump_claim=dump_claim, standby=standby)
    return with_standby(prep) if start_workers else prep


def with_standby(prep: Prepared) -> Prepared:
    """The run with its standby workers started, with the count decided (as `prepare(..., start_workers=True)`
    starts them): the CLI's resume starts them only once it knows there is something to do (run/settled.py)."""
    if prep.standby is None and not prep.opts.ray and 0 < prep.workers <= STANDBY_MAX:
        return replace(prep, standby=Standby(prep.workers, preload_hf=prep.preload_hf))
    return prep


def _check_ray(opts: RunOptions, cfg: BuildConfig, backend: backends.BackendSpec) -> None:
    """--ray: a well-formed address that answers, a run that can go there."""
    from builder.run.ray_pool import check_address, check_reachable  # noqa: PLC0415

    check_address(opts.ray)
    if opts.imports is not None:
        raise UsageError(f"--ray {opts.ray}: an import reads a dump's files on this node; run it without --ray")
    if backend.server and not opts.launch:
        from builder.run.ray_engines import check_connect_server  # noqa: PLC0415

        check_connect_server(cfg)
    check_reachable(opts.ray)  # a silent address fails here, in one line, before the lock


def stop_grace(value: float | None) -> float:
    """Seconds the workers get to finish their sample in hand after a stop request (--stop-grace, else
    $HSBUILD_STOP_GRACE, else STOP_GRACE_SECONDS)."""
    if value is None:
        raw = os.environ.get("HSBUILD_STOP_GRACE")
        if not raw:
            return STOP_GRACE_SECONDS
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"HSBUILD_STOP_GRACE={raw!r}: not a number of seconds") from None
    if not value >= 0:
        raise UsageError(f"stop grace {value}: must be 0 or more seconds")
    return float(value)
