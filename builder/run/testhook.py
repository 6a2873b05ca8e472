"""A test hook (for the test suite only; it does nothing unless HSBUILD_TEST_HOLD is set): holds a worker at a
known point of a run, so that a test acts on a run that is certainly still going (a kill -9, a Ctrl-C, a status
query, a stall) instead of guessing a sample count large enough for the run to outlast its action.

HSBUILD_TEST_HOLD="K:DIR": when a worker has taken its K-th task of the run (K >= 1) and reported it `started`,
before it extracts it, it writes `DIR/reached-W` (W: the worker's number; the file holds the worker's pid) and
waits until `DIR/gate` exists, then goes on. So a held worker has a sample in hand, and the K-1 before it were
handed to its backend (with HSBUILD_GROUP_SAMPLES=1 also made durable and reported). Each worker holds once,
at its own K-th task. It waits at most HOLD_MAX_S, then goes on anyway: a test that failed before opening the
gate never leaves a worker held for good.

Several holds, each with its own folder: "K1:DIR1;K2:DIR2" (a worker holds at its K1-th task on DIR1, and again
at its K2-th on DIR2).

The test waits for a `reached-*` file, acts, then creates `gate` (tests/conftest.py: the `hold` fixture).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "HSBUILD_TEST_HOLD"
HOLD_MAX_S = 600.0
POLL_S = 0.02
_taken: dict[int, int] = {}  # worker number -> tasks it took so far (this process)


def _settings() -> list[tuple[int, Path]]:
    raw = os.environ.get(ENV)
    if not raw:
        return []
    holds = []
    for one in raw.split(";"):
        k, _, folder = one.partition(":")
        holds.append((int(k), Path(folder)))
    return holds


def before_task(worker: int) -> None:
    """Called by a worker for each task it takes, once it said `started` (builder/run/worker.py). Holds at the
    K-th (see above)."""
    holds = _settings()
    if not holds:
        return
    _taken[worker] = n = _taken.get(worker, 0) + 1
    for k, folder in holds:
        if n == k:
            _hold(worker, folder)


def _hold(worker: int, folder: Path) -> None:
    gate = folder / "gate"
    tmp = folder / f".reached-{worker}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.replace(folder / f"reached-{worker}")
    deadline = time.monotonic() + HOLD_MAX_S
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
