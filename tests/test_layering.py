"""The package layout holds: no import runs from a lower layer up to a higher one, and only the CLI renders.

Layers, lowest first (docs/design.md, "Package layout"): a module may import its own package and any package
of a lower layer, never one of a higher layer. The exemptions are listed below (DEPRECATED_ALIASES).
"""

from __future__ import annotations

import ast
from pathlib import Path

import builder

PKG = Path(builder.__file__).resolve().parent

LAYERS = [
    {"errors", "layout", "fsutil", "mounts", "procfs", "humanize", "progress", "config"},  # foundation: plain modules
    {"log", "store", "formats"},  # formats: one module per trainer file format
    {"extract", "space"},
    {"verify", "doctor"},
    {"exchange"},  # export and import: a build in and out of trainers' files
    {"run"},
    {"reader"},  # the stable import for training code: the torch dataset, speculators' transfer plugin
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Deprecated aliases: a module left at an old path only to re-export its new home, which may sit in a higher layer.
# Each may import upward only the module it stands for.
DEPRECATED_ALIASES = {
    "builder/formats/speculators_transfer.py": "builder.reader.speculators_transfer",
}


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


def test_no_import_runs_up_a_layer():
    violations = []
    for path in modules():
        me = unit_of(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        if me == "__init__":
            continue
        for line, mod in imports(path):
            other = unit_of(mod)
            if other == "__version__" or other == me:
                continue
            rel = str(path.relative_to(PKG.parent))
            if DEPRECATED_ALIASES.get(rel) == mod:
                continue
            if RANK[other] >= RANK[me] and not (RANK[other] == RANK[me] == 0):
                violations.append(f"{path.relative_to(PKG.parent)}:{line} imports {mod}")
    # the foundation's plain modules may use each other only downward in this order
    assert not violations, "imports running up (or across) layers:\n" + "\n".join(violations)


def test_the_exemptions_name_imports_that_exist():
    """An exemption whose import is gone is dropped, not left to excuse a later one."""
    for rel, mod in DEPRECATED_ALIASES.items():
        assert mod in {m for _, m in imports(PKG.parent / rel)}, f"{rel} no longer imports {mod}: drop the exemption"


def test_only_the_cli_prints():
    offenders = []
    for path in modules():
        rel = path.relative_to(PKG)
        if rel.parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"print() outside builder/cli: {offenders}"
