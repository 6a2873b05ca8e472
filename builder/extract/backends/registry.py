"""The backends: which exist, and what the rest of hsbuild asks of each (its `BackendSpec`).

A backend is one module or one package (a plug-in), and nothing outside it names it: the CLI's `--backend`
choices and help, init's checks and recorded metadata, the worker count `auto` stands for, the preflight's device,
whether a run waits for (and checks, and launches) an inference server, `serve-command`, doctor's server and
orphan checks, Ray's placement and how a worker opens the backend all ask the spec (an engine with a server: its
`server` hooks, builder/extract/backends/serving.py). The core imports no plug-in; it finds them by name here:

- built in: a module or package of this package that declares its spec at its top level, on a line of its own
  (in the package: its `__init__.py`),

      BACKEND = register(BackendSpec(name="...", summary="...", open=_open, ...))

  found by reading this package's sources rather than importing them (a server-side module such as an engine's KV
  connector imports the engine), and imported on first use;
- installed: an entry point in the group `hsbuild.backends` (`NAME = "package.module"`, in the plug-in's
  pyproject.toml `[project.entry-points."hsbuild.backends"]`), whose module calls `register` when imported: read
  when a name is not built in, or when the names are listed. Every process finds it so (a run's workers, Ray's
  actors on other nodes, where the plug-in is installed too);
- `register(spec)` called by a program itself: known to that process only.

A backend module MUST stay cheap to import: no torch or numpy at its top level (init, the CLI and the sizing read
specs without them; the worker imports what it needs when it opens the backend).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.errors import UsageError

if TYPE_CHECKING:
    from builder.config import BuildConfig
    from builder.extract.backends.serving import EngineProcesses, ServerEngine

DECLARATION = re.compile(r"^BACKEND = register\(", re.MULTILINE)  # how a module says it is a backend
GROUP = "hsbuild.backends"  # the entry points of installed backends: NAME = "package.module"


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
    server: ServerEngine | None = None  # an inference server runs the model (its hooks: serving.ServerEngine):
    # init needs --server and --staging; a run waits for the server, checks it is the build's, can launch it
    # (--launch, serve-command); doctor checks it (env.server) and names its orphaned processes
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
    generates: bool = False  # it honours Request.generate (returns States with output_ids and finish_reason, or a
    # Failure): `init --regenerate` refuses a backend that does not
    # a backend that generates: why it cannot honour a build's generation settings (hsbuild.toml's temperature,
    # top_p, ...: a mapping), one line naming the flag and what to use instead; None: it can. Asked by init
    generation_problem: Callable[[Mapping[str, object]], str | None] | None = None

    def setting(self, cfg: BuildConfig, key: str) -> object:
        """hsbuild.toml's `key`, else this backend's default for it."""
        value = getattr(cfg, key, None)
        return self.options.get(key) if value is None else value


_SPECS: dict[str, BackendSpec] = {}
_lock = threading.RLock()
_loaded = False  # the built-in backends are imported
_installed: dict[str, str] | None = None  # entry point name -> its module, once read
_broken: dict[str, str] = {}  # entry point name -> why its module could not be imported


def register(spec: BackendSpec) -> BackendSpec:
    """Called by a backend module, once, at its top level (see the module's docstring). A name another module
    registered already is refused (ValueError): a plug-in never replaces a backend silently."""
    with _lock:
        old = _SPECS.get(spec.name)
        if old is not None and old.open.__module__ != spec.open.__module__:
            raise ValueError(f"backend {spec.name!r}: registered by {old.open.__module__} already, not again by "
                             f"{spec.open.__module__}")
        _SPECS[spec.name] = spec
    return spec


def _load() -> None:
    """Import every built-in backend of this package, module or package (once)."""
    global _loaded  # noqa: PLW0603
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        here = Path(__file__).parent
        found = [(p.stem, p) for p in here.glob("*.py") if p.stem != "registry"]
        found += [(p.parent.name, p) for p in here.glob("*/__init__.py")]
        for name, path in sorted(found):
            if DECLARATION.search(path.read_text(encoding="utf-8")):
                importlib.import_module(f"{__package__}.{name}")
        _loaded = True


def _entry_points() -> dict[str, str]:
    """The installed backends' entry points (name -> module), read once."""
    global _installed  # noqa: PLW0603
    with _lock:
        if _installed is None:
            _installed = {ep.name: ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group=GROUP)}
        return _installed


def _load_installed(name: str | None = None) -> None:
    """Import the installed backend `name` (None: every one) unless registered already; a module that fails to
    import, or registers no backend of its entry point's name, is kept as broken (named when it is asked for)."""
    for ep, module in _entry_points().items():
        if (name is not None and ep != name) or ep in _SPECS or ep in _broken:
            continue
        with _lock:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - one broken plug-in must not take the others down
                _broken[ep] = f"{GROUP} entry point {ep} = {module}: {type(e).__name__}: {e}"
                continue
            if ep not in _SPECS:
                _broken[ep] = f"{GROUP} entry point {ep} = {module}: the module registered no backend {ep!r}"


def _find(name: str) -> BackendSpec | None:
    _load()
    if name not in _SPECS:
        _load_installed(name)
    return _SPECS.get(name)


def specs() -> list[BackendSpec]:
    """Every registered backend (built in and installed), by name."""
    _load()
    _load_installed()
    return [_SPECS[n] for n in sorted(_SPECS)]


def names() -> list[str]:
    """The backends a build may name (`init --backend`, hsbuild.toml's `backend`)."""
    return [s.name for s in specs() if s.selectable]


def get(name: str) -> BackendSpec:
    """The backend `name`, selectable or not (KeyError for none)."""
    spec = _find(name)
    if spec is None:
        raise KeyError(_broken.get(name, name))
    return spec


def declared(name: str) -> bool:
    """A backend of this name is registered, or an installed plug-in declares it (one that fails to load
    included: `choose` then says why)."""
    return _find(name) is not None or name in _broken


def _unknown(name: str, what: str) -> UsageError:
    if name in _broken:
        return UsageError(f"{what}: its plug-in cannot be loaded ({_broken[name]}); fix or reinstall it")
    return UsageError(f"{what}: use one of {', '.join(names())}")


def choose(name: str, flag: str = "--backend") -> BackendSpec:
    """The backend a new build names (`init --backend NAME`); UsageError naming the choices."""
    spec = _find(name)
    if spec is None or not spec.selectable:
        raise _unknown(name, f"{flag} {name}")
    return spec


def of_config(cfg: BuildConfig, path: Path | str | None = None) -> BackendSpec:
    """The backend of a build (its hsbuild.toml at `path`); UsageError for one that is not known here."""
    spec = _find(cfg.backend)
    if spec is None or not spec.selectable:
        where = f"{path}: " if path else ""
        raise _unknown(cfg.backend, f"{where}backend = {cfg.backend!r}")
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
    return [s.name for s in specs() if s.selectable and s.server is not None]


def described() -> str:
    """Each build backend and what runs its forward passes, for help texts ('inprocess: the workers load the
    model; ...')."""
    return "; ".join(f"{s.name}: {s.summary}" for s in specs() if s.selectable)


def engine_processes() -> list[EngineProcesses]:
    """How the registered engines' processes look in /proc (doctor's env.engine_orphans)."""
    return [s.server.processes for s in specs() if s.server is not None and s.server.processes is not None]


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
