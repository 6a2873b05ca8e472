"""A one-line progress bar on stderr: samples/s, tokens/s, MB/s, ETA. Silent when stderr is not a terminal.

The CLI's implementation of the library's `builder.progress.Progress` protocol."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from builder.humanize import human_seconds


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start(0, "extract")

    def start(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        self.done = self.tokens = self.nbytes = 0
        self.note = ""
        self.started = False

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        if self.done == 0 and done and not self.started:  # rates count from the first result, not model loading
            self.t0, self.started = time.monotonic(), True
        self.done += done
        self.tokens += tokens
        self.nbytes += nbytes
        self.note = note
        now = time.monotonic()
        if self.enabled and now - self.last_draw > 0.2:
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        el = max(now - self.t0, 1e-6)
        rate = self.done / el
        eta = (self.total - self.done) / rate if rate > 0 else None
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        line = (f"\r{self.label} [{bar}] {self.done}/{self.total} {rate:.1f} samples/s "
                f"{self.tokens / el:,.0f} tok/s {self.nbytes / el / 1e6:.1f} MB/s ETA {human_seconds(eta)}")
        if self.note:
            line += f"  {self.note}"
        self.stream.write(line[:200].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def progress_for(args) -> ProgressBar:
    """The bar for a command's `--no-progress` flag: off when given, else on only on a terminal."""
    return ProgressBar(enabled=False if getattr(args, "no_progress", False) else None)
