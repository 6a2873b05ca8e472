"""A one-line progress bar on stderr: samples/s, tokens/s, MB/s, ETA. Silent when stderr is not a terminal.

The CLI's implementation of the library's `builder.progress.Progress` protocol. Rates count from the first
result (not model loading), and are shown only once they mean something: RATE_AFTER_S seconds and at least one
more result after the first (before that the bar says `measuring rate`; a first tick would otherwise divide a
whole group of results by a few microseconds)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from builder.humanize import human_seconds

RATE_AFTER_S = 2.0


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self.start(0, "extract")

    def start(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.t0: float | None = None  # when the first result came
        self.base = (0, 0, 0)  # done, tokens, bytes at the first result: rates count what came after it
        self.last_draw = 0.0
        self.done = self.tokens = self.nbytes = 0
        self.note = ""

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        now = self.clock()
        self.done += done
        self.tokens += tokens
        self.nbytes += nbytes
        if self.t0 is None and done:
            self.t0, self.base = now, (self.done, self.tokens, self.nbytes)
        self.note = note
        if self.enabled and now - self.last_draw > 0.2:
            self.last_draw = now
            self._draw(now)

    def rates(self, now: float) -> tuple[float, float, float] | None:
        """(samples/s, tokens/s, bytes/s) since the first result, or None while that is not yet meaningful."""
        if self.t0 is None or now - self.t0 < RATE_AFTER_S or self.done <= self.base[0]:
            return None
        el = now - self.t0
        return ((self.done - self.base[0]) / el, (self.tokens - self.base[1]) / el, (self.nbytes - self.base[2]) / el)

    def _draw(self, now: float, final: bool = False) -> None:
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        line = f"\r{self.label} [{bar}] {self.done}/{self.total} "
        r = self.rates(now)
        if r is None:
            line += "" if final else "measuring rate ..."
        else:
            eta = (self.total - self.done) / r[0] if r[0] > 0 else None
            line += (f"{r[0]:.1f} samples/s {r[1]:,.0f} tok/s {r[2] / 1e6:.1f} MB/s ETA {human_seconds(eta)}")
        if self.note:
            line += f"  {self.note}"
        self.stream.write(line[:200].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(self.clock(), final=True)
            self.stream.write("\n")
            self.stream.flush()


def progress_for(args) -> ProgressBar:
    """The bar for a command's `--no-progress` flag: off when given, else on only on a terminal."""
    return ProgressBar(enabled=False if getattr(args, "no_progress", False) else None)
