"""Commands beyond the core (verify, gc, doctor): each registers its parser and handler here."""

from __future__ import annotations

COMMANDS: dict = {}


def add_commands(sub, out) -> None:  # noqa: ARG001
    return None
