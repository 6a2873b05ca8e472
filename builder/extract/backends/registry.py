"""The backends: which exist, and what the rest of hsbuild asks of each (its `BackendSpec`).

A backend module of this package declares its spec at its top level, on a line of its own:

    BACKEND = register(BackendSpec(name="...", summary="...", open=_open, ...))

and nothing outside it names the backend: the CLI's `--backend` choices, init's checks and recorded metadata,
the worker count `auto` stands for, the preflight's device, whether a run waits for (and checks, and launches)
an inference server, `serve-command`, doctor's server check, and how a worker opens the backend all ask the
spec. Adding a backend is one module (and its tests).

The registry finds the backend modules by that line, reading this package's sources rather than importing them
(a helper module such as vllm_connector imports vLLM), and imports them on first use. So a backend module MUST
stay cheap to import: no torch or numpy at its top level (init, the CLI and the sizing read specs without
them; the worker imports what it needs when it opens the backend).
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.errors import UsageError

if TYPE_CHECKING:
    from builder.config import BuildConfig

DECLARATION = re.compile(r"^BACKEND = register\(", re.MULTILINE)  # how a module says it is a backend


@dataclass(frozen=True)
class RunContext:
    """What a run knows when it makes its workers' backend settings (`BackendSpec.worker_settings`)."""

    cfg: BuildConfig
    meta: dict  # the build's metadata (hidden_size, num_layers, aux_layers, ...)
    model_name: str = ""  # server backends: the name the server serves the model under
    staging_dir: str = ""  # server backends: the build's own subfolder of the server's staging folder
    imports: Any = None  # an import (`reads_dumps`): exchange.imports.ImportOptions (format, final_state)


def _no_settings(_ctx: RunContext) -> None:
    return None


@dataclass(frozen=True)
class BackendSpec:
    """One backend, as the rest of hsbuild sees it."""

    name: str  # `backend` in hsbuild.toml (a format key), `--backend`
    summary: str  # what runs the forward passes, as a phrase for messages: "the workers load the model"
    # the worker: (WorkerSettings, recheck) -> (Extractor, Backend). `recheck` (server backends, else None) is
    # run before requests go out again after the server was away; raises ServerRefused for another server
    open: Callable[[Any, Callable[[], object] | None], tuple[Any, Any]]
    selectable: bool = True  # a build names it (`init --backend`); False: a run picks it itself (an import)
    server: bool = False  # an inference server runs the model: init needs --server and --staging; a run waits
    # for the server, checks it is the build's, can launch it (--launch); doctor checks it (env.server)
    loads_model: bool = False  # each worker loads its own copy of the model: `auto` sizes the workers by
    # memory and GPUs, a worker says its device, a Hugging Face model is preloaded while workers wait
    device: str | None = None  # where its workers compute whatever --device says ("cpu": the GPUs are the
    # server's, or nothing is computed); None: the run's --device (the preflight checks that device)
    final_state: str | None = None  # the one final state it returns (the other is derived with the kept final
    # norm, when it can be); None: it computes either
    reads_dumps: bool = False  # its states come from a dump's files (`hsbuild import`), not forward passes
    options: Mapping[str, object] = field(default_factory=dict)  # hsbuild.toml keys only it reads: defaults
    # init: checks what the build needs of this backend (raises UsageError); returns what the build's metadata
    # records about it besides `backend` and `server`. Given the model's metadata (Extractor or ModelInfo)
    check_init: Callable[[Any], dict] | None = None
    worker_settings: Callable[[RunContext], object | None] = _no_settings  # WorkerSettings.backend_settings
    serve_command: Callable[[BuildConfig, dict], str] | None = None  # server backends: the shell line that
    # starts the build's server (`hsbuild serve-command`), given hsbuild.toml and the build's metadata

    def setting(self, cfg: BuildConfig, key: str) -> object:
        """hsbuild.toml's `key`, else this backend's default for it."""
        value = getattr(cfg, key, None)
        return self.options.get(key) if value is None else value


_SPECS: dict[str, BackendSpec] = {}
_lock = threading.RLock()
_loaded = False


def register(spec: BackendSpec) -> BackendSpec:
    """Called by a backend module, once, at its top level (see the module's docstring)."""
    _SPECS[spec.name] = spec
    return spec


def _load() -> None:
    """Import every backend module of this package (once)."""
    global _loaded  # noqa: PLW0603
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for path in sorted(Path(__file__).parent.glob("*.py")):
            if path.stem != "registry" and DECLARATION.search(path.read_text(encoding="utf-8")):
                importlib.import_module(f"{__package__}.{path.stem}")
        _loaded = True


def specs() -> list[BackendSpec]:
    """Every registered backend, by name."""
    _load()
    return [_SPECS[n] for n in sorted(_SPECS)]


def names() -> list[str]:
    """The backends a build may name (`init --backend`, hsbuild.toml's `backend`)."""
    return [s.name for s in specs() if s.selectable]


def get(name: str) -> BackendSpec:
    """The backend `name`, selectable or not (KeyError for none)."""
    _load()
    return _SPECS[name]


def choose(name: str, flag: str = "--backend") -> BackendSpec:
    """The backend a new build names (`init --backend NAME`); UsageError naming the choices."""
    _load()
    spec = _SPECS.get(name)
    if spec is None or not spec.selectable:
        raise UsageError(f"{flag} {name}: use one of {', '.join(names())}")
    return spec


def of_config(cfg: BuildConfig, path: Path | str | None = None) -> BackendSpec:
    """The backend of a build (its hsbuild.toml at `path`); UsageError for one that is not known here."""
    _load()
    spec = _SPECS.get(cfg.backend)
    if spec is None or not spec.selectable:
        where = f"{path}: " if path else ""
        raise UsageError(f"{where}backend = {cfg.backend!r}: use one of {', '.join(names())}")
    return spec


def importer() -> BackendSpec:
    """The backend that reads a dump's files (`hsbuild import`)."""
    found = [s for s in specs() if s.reads_dumps]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} backends read dumps; exactly one must")
    return found[0]


def for_run(cfg: BuildConfig, importing: bool, path: Path | str | None = None) -> BackendSpec:
    """The backend a run drives: the importer for an import, else the build's."""
    build = of_config(cfg, path)
    return importer() if importing else build


def with_server() -> list[str]:
    """The backends whose model an inference server runs (for messages that name them)."""
    return [s.name for s in specs() if s.selectable and s.server]


def check_options(spec: BackendSpec, given: Mapping[str, object]) -> None:
    """Refuse init flags that only other backends take (`given`: {hsbuild.toml key: the flag's value, None:
    not given}), in one line naming the flag and the backends that take it."""
    for key, value in given.items():
        if value is None or key in spec.options:
            continue
        owners = [s.name for s in specs() if s.selectable and key in s.options]
        if owners:
            raise UsageError(f"--{key.replace('_', '-')} {value}: only for --backend {' or '.join(owners)} "
                             f"(--backend {spec.name}: {spec.summary})")
