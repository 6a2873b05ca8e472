"""How the library reports progress: a callback object the caller passes in. The library never draws; the
CLI renders it (builder/cli/progress.py)."""

from __future__ import annotations

from typing import Protocol


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
