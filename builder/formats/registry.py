"""The trainer formats: each one module, registered here once by name and imported on first use (as vLLM's
KV-connector factory registers a connector: a name, the module that holds it, its class). Nothing else in hsbuild
imports a format module or names a format: the CLI's `--format` choices and help, the table of formats in
docs/design.md (`docs_table`), export, import, `HiddenStateDataset(format=)` and `init`'s list of the trainers a
build feeds all ask the registry, and each format's class says the rest (builder/formats/base.py).

A format module MUST stay cheap to import (no torch, numpy or pyarrow at its top level): the CLI and `init` read
the formats' class attributes without them; the methods import what they use.

A format from outside hsbuild is registered by `register(name, "package.module:Class")`. The processes this one
starts learn it from the environment (a run's workers, which read the files of an import, and `hsbuild`
commands): `register` adds it to HSBUILD_FORMATS (`name=package.module:Class` entries, comma-separated), which
every lookup reads, so setting that variable registers a format for the command line too.
"""

from __future__ import annotations

import importlib
import os
import re

from builder.errors import FormatError
from builder.formats.base import TrainerFormat

ENV = "HSBUILD_FORMATS"
BUILTIN = {  # in the order the CLI, `init` and the docs list them
    "specforge": "builder.formats.specforge:SpecForge",
    "speculators": "builder.formats.speculators:Speculators",
    "modelopt": "builder.formats.modelopt:ModelOpt",
    "pt": "builder.formats.pt:PlainPt",
    "chat": "builder.formats.chat:Chat",
}
# options a caller always passes, with a default (`hsbuild import --dump-final-state`): given to the formats that
# take them, left out for the others (whose files say it)
DEFAULTED = ("final_state",)
NAME = re.compile(r"[a-z][a-z0-9_-]*")
TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

_classes: dict[tuple[str, str], type[TrainerFormat]] = {}


def _extra() -> dict[str, str]:
    """The formats registered from outside hsbuild: HSBUILD_FORMATS, in its order."""
    raw = os.environ.get(ENV, "").strip()
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        name, _, target = entry.partition("=")
        name, target = name.strip(), target.strip()
        if not NAME.fullmatch(name) or not TARGET.fullmatch(target):
            raise FormatError(f"{ENV}: {entry!r}: give each format as name=package.module:Class, comma-separated")
        if name in BUILTIN:
            raise FormatError(f"{ENV}: {entry!r}: {name} is hsbuild's own format; register yours under another name")
        out[name] = target
    return out


def _targets() -> dict[str, str]:
    return {**BUILTIN, **_extra()}


def _write(extra: dict[str, str]) -> None:
    if extra:
        os.environ[ENV] = ",".join(f"{n}={t}" for n, t in extra.items())
    else:
        os.environ.pop(ENV, None)


def register(name: str, target: str) -> None:
    """Register the format `name`, the class `target` ("package.module:Class", imported on first use), for this
    process and the processes it starts (HSBUILD_FORMATS). Registering the same again does nothing; another
    target under a registered name raises FormatError."""
    if not NAME.fullmatch(name) or not TARGET.fullmatch(target):
        raise FormatError(f"format {name!r} = {target!r}: give a lowercase name and package.module:Class")
    extra = _extra()
    have = BUILTIN.get(name) or extra.get(name)
    if have == target:
        return
    if have is not None:
        raise FormatError(f"format {name!r}: registered already ({have}); register {target} under another name")
    _write({**extra, name: target})


def unregister(name: str) -> None:
    """Forget a format registered with `register` (hsbuild's own stay)."""
    if name in BUILTIN:
        raise FormatError(f"format {name!r}: hsbuild's own format cannot be unregistered")
    extra = _extra()
    extra.pop(name, None)
    _write(extra)


def names(exports: bool | None = None, imports: bool | None = None, states: bool | None = None) -> list[str]:
    """The registered formats (those that export, or import, or hold hidden states, when asked), in order."""
    return [f.name for f in formats(exports, imports, states)]


def formats(exports: bool | None = None, imports: bool | None = None,
            states: bool | None = None) -> list[type[TrainerFormat]]:
    """The registered formats' classes (those that export, or import, or hold hidden states, when asked), in
    order."""
    return [f for f in (get(n) for n in _targets()) if _is(f, exports, imports, states)]


def get(name: str, flag: str = "--format", exports: bool | None = None,
        imports: bool | None = None, states: bool | None = None) -> type[TrainerFormat]:
    """The class of format `name`; FormatError naming the choices for a name not registered (or registered but
    not one that exports, or imports, or holds hidden states, when asked)."""
    target = _targets().get(name)
    cls = None if target is None else _classes.get((name, target))
    if target is not None and cls is None:
        cls = _classes[(name, target)] = _load(name, target)
    if cls is None or not _is(cls, exports, imports, states):
        raise FormatError(f"{flag} {name}: use one of {', '.join(names(exports, imports, states))}")
    return cls


def _is(cls: type[TrainerFormat], exports: bool | None, imports: bool | None, states: bool | None) -> bool:
    return ((exports is None or cls.exports == exports) and (imports is None or cls.imports == imports)
            and (states is None or cls.states == states))


def _load(name: str, target: str) -> type[TrainerFormat]:
    module, _, attr = target.partition(":")
    where = "" if name in BUILTIN else f"{ENV}: "
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise FormatError(f"{where}format {name} ({target}) does not load: {type(e).__name__}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, TrainerFormat)):
        raise FormatError(f"{where}format {name} ({target}) is not a builder.formats.base.TrainerFormat")
    if getattr(cls, "name", None) != name:
        raise FormatError(f"{where}format {name} ({target}) calls itself {getattr(cls, 'name', None)!r}")
    return cls


def make_format(name: str, *, flag: str = "--format", exports: bool | None = None, imports: bool | None = None,
                states: bool | None = None, **options: object) -> TrainerFormat:
    """Format `name` (one that exports, or imports, or holds hidden states, when asked), with its options (an
    option given as None is not given). FormatError for an unknown name or an option the format does not take."""
    cls = get(name, flag, exports, imports, states)
    given = {k: v for k, v in options.items() if v is not None and (k in cls.options or k not in DEFAULTED)}
    for key in given:
        if key not in cls.options:
            takers = [f.name for f in formats() if key in f.options]
            raise FormatError(f"--{key.replace('_', '-')}: only --format {' or '.join(takers) or 'none'} takes it "
                              f"(not {name})")
    return cls(**given)


def option_help(key: str) -> str:
    """--help of a format option: which formats take it, and what it does."""
    return "; ".join(f"{f.name}: {f.options[key]}" for f in formats() if key in f.options)


COLUMNS = ("`--format`", "trainer (version checked)", "files (`hsbuild export`)", "a sample's tensors",
           "aux layer numbering", "final state", "its dataset yields", "reduced vocabulary")


def docs_table() -> str:
    """The table of formats in docs/design.md (section 13), one row a registered format."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for f in formats():
        what = ", ".join(w for w, yes in (("export", f.exports), ("import", f.imports)) if yes)
        d = f.doc
        cells = (f"`{f.name}` ({what})", d.trainer, d.files, d.tensors, d.numbering, d.final_state, d.yields,
                 d.vocab)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
