"""The package layout holds: no import runs from a lower layer up to a higher one, nor across to another package
of its own layer (that only the CLI prints: tests/test_library_output.py).

Layers, lowest first (docs/design.md, "Package layout"): a module may import its own package and any package
of a lower layer, never one of its own layer or a higher one; the foundation's plain modules import only those
before them in FOUNDATION. What is left to fix is listed by name in PENDING, each with who removes it; the one
exemption kept on purpose is a deprecated alias (DEPRECATED_ALIASES).
"""

from __future__ import annotations

import ast
from pathlib import Path

import builder

PKG = Path(builder.__file__).resolve().parent

# the foundation: plain modules, each importing only those before it
FOUNDATION = ["errors", "humanize", "progress", "mounts", "procfs", "fsutil", "subset", "layout", "config"]
LAYERS = [
    set(FOUNDATION),
    {"log", "store", "formats"},  # formats: one module per trainer file format
    {"extract", "space"},
    {"reader"},  # the stable import for training code: reads a build, needs none of the commands above
    # commands over a build (export and import: in and out of trainers' files; report: its history drawn)
    {"verify", "doctor", "exchange", "report"},
    {"run"},  # the run loop: composes preflight (doctor), import (exchange), the log's rebuild (verify's gc)
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Deprecated aliases: a module left at an old path only to re-export its new home, which may sit in a higher layer.
# Each may import upward only the module it stands for.
DEPRECATED_ALIASES = {
    "builder/formats/speculators_transfer.py": "builder.reader.speculators_transfer",
}

# Imports that still run up or across a layer (issue 42), each with who removes it. The list only shrinks: an entry
# whose import is gone fails the test, and the entry goes with it.
PENDING: dict[tuple[str, str], str] = {}


def runs_up(me: str, other: str) -> bool:
    """Does an import of unit `other` from unit `me` break the layering? (Units: `log`, `errors`, ...)"""
    if other == me:
        return False
    if RANK[me] == RANK[other] == 0:
        return FOUNDATION.index(other) > FOUNDATION.index(me)
    return RANK[other] >= RANK[me]


def unit_of(module: str) -> str:
    """`builder.log.events` -> `log`; `builder.errors` -> `errors`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against this module's package
                base = path.relative_to(PKG.parent).with_suffix("").parts[: -node.level]
                mod = ".".join(base + tuple(node.module.split(".")))
            else:
                mod = node.module
            if mod == "builder":
                found += [(node.lineno, f"builder.{a.name}") for a in node.names]
            elif mod.startswith("builder."):
                found.append((node.lineno, mod))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("builder.")]
    return found


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "_schema" not in p.parts)


def test_every_module_is_placed_in_a_layer():
    units = {unit_of(".".join(p.relative_to(PKG.parent).with_suffix("").parts)) for p in modules()}
    units.discard("__init__")
    assert units <= set(RANK), f"modules outside any layer: {sorted(units - set(RANK))}"


def upward_imports() -> list[tuple[str, str, int]]:
    """(module file, module imported, line) of every import that runs up or across a layer."""
    found = []
    for path in modules():
        me = unit_of(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        if me == "__init__":
            continue
        for line, mod in imports(path):
            other = unit_of(mod)
            if other == "__version__":
                continue
            rel = str(path.relative_to(PKG.parent))
            if DEPRECATED_ALIASES.get(rel) == mod:
                continue
            if runs_up(me, other):
                found.append((rel, mod, line))
    return found


def test_no_import_runs_up_a_layer():
    violations = [f"{rel}:{line} imports {mod}" for rel, mod, line in upward_imports() if (rel, mod) not in PENDING]
    assert not violations, "imports running up (or across) layers:\n" + "\n".join(violations)


def test_the_pending_list_names_imports_that_still_run_up():
    """A pending import that was fixed is dropped from PENDING, not left to excuse a later one."""
    gone = set(PENDING) - {(rel, mod) for rel, mod, _ in upward_imports()}
    assert not gone, f"fixed, drop from PENDING: {sorted(gone)}"


def test_the_rule_catches_imports_up_and_across():
    """The rule itself: up a layer, across to a sibling, and up the foundation's order are refused."""
    assert runs_up("log", "extract") and runs_up("reader", "exchange") and runs_up("run", "cli")
    assert runs_up("exchange", "verify") and runs_up("verify", "doctor") and runs_up("store", "log")
    assert runs_up("layout", "config") and runs_up("errors", "layout")
    assert not runs_up("config", "layout") and not runs_up("run", "verify") and not runs_up("reader", "store")
    assert not runs_up("verify", "verify")


def test_the_exemptions_name_imports_that_exist():
    """An exemption whose import is gone is dropped, not left to excuse a later one."""
    for rel, mod in DEPRECATED_ALIASES.items():
        assert mod in {m for _, m in imports(PKG.parent / rel)}, f"{rel} no longer imports {mod}: drop the exemption"

