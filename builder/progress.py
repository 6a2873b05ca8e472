"""How the library reports progress and messages: callbacks the caller passes in. The library never draws nor
prints; the CLI renders progress (builder/cli/progress.py) and prints the messages (each command's `echo`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Echo = Callable[[str], None]  # what a command says as it goes (a line, without its newline): the caller shows it


def quiet(message: str) -> None:
    """The default `echo`: say nothing. A library call is silent unless its caller passes an echo."""


class Progress(Protocol):
    def start(self, total: int, label: str) -> None:
        """A task of `total` items begins."""

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        """`done` more items finished (with their tokens and bytes); `note` is the current state, e.g. PAUSED."""

    def close(self) -> None:
        """The task ended."""


class NoProgress:
    """The default: report nothing."""

    def start(self, total: int, label: str) -> None:
        pass

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        pass

    def close(self) -> None:
        pass
