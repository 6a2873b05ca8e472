"""Commands beyond the core. Each module in COMMAND_MODULES has `add_commands(sub, out)` and a `COMMANDS` dict."""

from __future__ import annotations

import importlib

COMMAND_MODULES = ("builder.cli_verify", "builder.cli_doctor")
COMMANDS: dict = {}


def add_commands(sub, out) -> None:
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        mod.add_commands(sub, out)
        COMMANDS.update(mod.COMMANDS)
