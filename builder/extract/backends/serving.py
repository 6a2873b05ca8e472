"""The server-engine interface: what an engine whose model runs in an inference server provides besides its
request path (base.Backend), as the run, the CLI and doctor ask for it. A plug-in subclasses `ServerEngine` and
sets an instance as its spec's `server` (registry.BackendSpec); nothing outside the plug-in knows more of it.

The core keeps what every such server shares (builder/run/server_lifecycle.py: wait for `/health`, launch the
command, restart it, stop its process group; builder/extract/backends/staging.py: the build's own staging
subfolder, files read under their locks, cleared by each run) and asks the engine for what is its own:

- `plan(cfg, meta)`: the build's server (a `ServerPlan`): its URL, its staging folder, the exact command that
  starts it (`hsbuild serve-command`, `run --launch`) and the variables that command needs;
- `identity(request)`: the check that a running server is the build's (a `ServerIdentity`), run before a sample
  goes to it and again by each worker whenever the server comes back;
- `doctor(request)`: what `hsbuild doctor` finds about the server (`Finding`s: env.server);
- `processes`: how its processes look in /proc, so doctor names the ones left without their server
  (env.engine_orphans);
- `placement(node, launch)` and `settings_at(...)`: one server per node with `--ray` (the actor's resources,
  a worker pointed at its node's server).

Everything here is cheap to import (no torch, no numpy): a spec is read by init and the CLI.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from builder.extract.backends.http_client import EngineUnavailable, healthy

if TYPE_CHECKING:
    from builder.config import BuildConfig

OK, WARN, FAIL = "ok", "warn", "fail"  # a Finding's status (doctor's)


class NeverFits(EngineUnavailable):
    """The staging volume cannot hold the smallest file the server stages, even when empty: waiting for room
    would wait forever (a run's start stops with exit 3)."""


class ServerPlan(Protocol):
    """The build's server as its engine describes it (frozen, picklable: a Ray actor gets one)."""

    server: str  # http://HOST:PORT
    staging: str  # the server's staging folder (absolute): the build stages into its own subfolder of it

    def argv(self) -> list[str]:
        """The exact command that starts the server."""
        ...

    def env(self) -> dict[str, str]:
        """The variables the command needs beside the environment."""
        ...

    def at(self, server: str, staging: str) -> ServerPlan:
        """The same server listening at `server` and staging into `staging` (one a node with --ray)."""
        ...


class ServerIdentity(Protocol):
    """The check that the server is the build's (picklable: each worker holds one)."""

    def check(self) -> dict:
        """What the server was found serving, recorded in the run's `engine_probe` event: `model_id` (the name
        requests use), `trusted` (why its configuration could not be read, when --trust-server let it pass), and
        whatever the engine records. Raises http_client.ServerRefused (one line naming both sides) when it is
        not the build's, EngineUnavailable when it cannot be asked (NeverFits: its staging volume is too small)."""
        ...

    def confirmed(self, found: dict) -> ServerIdentity:
        """The check the workers run whenever the server comes back, given what the run's first check found
        (a server that comes back as another must fail it)."""
        ...


@dataclass(frozen=True)
class IdentityRequest:
    """What a run knows when it asks for the identity check of its server."""

    plan: ServerPlan
    cfg: BuildConfig
    meta: dict  # the build's metadata (hidden_size, vocab_size, the engine's layer ids, ...)
    staging_dir: str  # the build's own subfolder of the server's staging folder
    build_root: str
    recorded: dict | None = None  # the build's first `engine_probe` (its reference), None on its first run
    trust: bool = False  # --trust-server: a server whose configuration cannot be read is judged by its answers


@dataclass(frozen=True)
class DoctorRequest:
    """What doctor gives an engine's checks. `meta` and `first_probe` read the event log when called."""

    cfg: BuildConfig
    build_root: str
    meta: Callable[[], dict]
    first_probe: Callable[[], dict | None]  # the build's first `engine_probe` detail (its reference)
    live: bool = False  # a run owns the build now (it may be using the server: send it nothing)


@dataclass
class Finding:
    """One doctor check's result (doctor turns it into its Check). `serving`: the server was found to be the
    build's; doctor then adds what it sees beside it (another process holding the GPUs)."""

    name: str  # e.g. env.server
    status: str  # OK | WARN | FAIL
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    serving: bool = False


@dataclass(frozen=True)
class EngineProcesses:
    """How an engine's processes look in /proc (doctor's env.engine_orphans). Its engine processes carry a
    setproctitle title PREFIX::NAME (cut to 15 bytes in /proc/PID/comm); its servers run `python -m MODULE...`,
    a console script, or carry a server title."""

    family: str  # the key findings carry, e.g. the backend's name
    name: str  # as people write it
    title_prefixes: tuple[str, ...]  # PREFIX of its engine processes' titles
    prefix_env: str | None = None  # a variable that sets another PREFIX
    server_titles: tuple[str, ...] = ()  # NAMEs (their start) of titled processes that are servers, not engines
    modules: tuple[str, ...] = ()  # `python -m MODULE[.sub]` runs a server
    scripts: tuple[str, ...] = ()  # console scripts (argv[0] or argv[1]'s basename) that run a server

    def prefixes(self) -> tuple[str, ...]:
        custom = os.environ.get(self.prefix_env) if self.prefix_env else None
        return (*self.title_prefixes, *([custom] if custom else []))


class ServerEngine:
    """The hooks of a server engine (see the module's docstring). `plan` and `identity` are required; the rest
    have defaults that fit an engine whose server needs no GPU of its own and whose worker settings are a
    dataclass with `server` and `staging` fields."""

    processes: EngineProcesses | None = None

    def plan(self, cfg: BuildConfig, meta: dict) -> ServerPlan:
        raise NotImplementedError

    def identity(self, request: IdentityRequest) -> ServerIdentity:
        raise NotImplementedError

    def doctor(self, request: DoctorRequest) -> list[Finding]:
        """By default: whether the server answers `/health` (a run waits for one that does not)."""
        url = request.cfg.server or "?"
        if healthy(url):
            return [Finding("env.server", OK, f"{url} is healthy", data={"server": url, "healthy": True})]
        return [Finding("env.server", WARN, f"{request.cfg.backend} server {url} is not reachable (a run waits for "
                        "it)", f"start it with the command `hsbuild serve-command {request.build_root}` prints, or "
                        "run with --launch", {"server": url, "healthy": False})]

    def healthy(self, server: str, timeout: float = 2.0) -> bool:
        return healthy(server, timeout)

    def placement(self, node: dict, launch: bool) -> dict[str, float]:
        """Ray resources of the actor that watches (and with --launch starts) node `node`'s server (`node`: an
        entry of ray.nodes())."""
        return {"num_cpus": 0, "num_gpus": 0}

    def settings_at(self, settings: object, server: str, staging_dir: str) -> object:
        """The workers' backend settings (its spec's `worker_settings`) pointed at another server and staging
        subfolder (a node's, with --ray)."""
        return dataclasses.replace(settings, server=server, staging=staging_dir)  # type: ignore[type-var]


def printable(plan: ServerPlan) -> str:
    """The command as a shell line, its variables in front: what `serve-command` prints, to run as printed."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env().items())
    return (env + " " if env else "") + shlex.join(plan.argv())
