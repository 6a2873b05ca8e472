"""Test hooks (for the test suite only; they do nothing unless HSBUILD_TEST_HOLD or HSBUILD_TEST_KILL_AFTER_RECORD
is set; the second: `after_record`, at the end). The first holds a worker at a
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

Out of the product's way: a worker reads the variable once (its first task; a forked child reads it anew) and
each task costs a look at that list. A malformed value is refused when a run starts (`check_environment`, the
Coordinator), in one line naming the variable and its form, before any sample is taken.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from builder.errors import UsageError

ENV = "HSBUILD_TEST_HOLD"
FORM = "K:DIR, or several as K1:DIR1;K2:DIR2 (K >= 1: the task a worker holds at; DIR: an existing folder)"
HOLD_MAX_S = 600.0
POLL_S = 0.02
_holds: list[tuple[int, Path]] | None = None  # this process's, read at its first task
_taken: dict[int, int] = {}  # worker number -> tasks it took so far (this process)


def parse(raw: str | None) -> list[tuple[int, Path]]:
    """The holds a value of HSBUILD_TEST_HOLD asks for ([] when unset or empty); UsageError when malformed."""
    if not raw:
        return []
    holds = []
    for one in raw.split(";"):
        k, sep, folder = one.partition(":")
        n = int(k) if k.strip().isdigit() else 0
        if not sep or n < 1 or not folder or not Path(folder).is_dir():
            raise UsageError(f"{ENV}={raw!r}: {one!r} is not of the form {FORM}; it is the test suite's hook: unset "
                             "it, or fix it")
        holds.append((n, Path(folder)))
    return holds


def check_environment() -> None:
    """A run's start (before any sample is taken): a malformed HSBUILD_TEST_HOLD is refused here, in one line,
    not met by a worker in the middle of the run."""
    parse(os.environ.get(ENV))


def holds() -> list[tuple[int, Path]]:
    """This process's holds, read from the environment once."""
    global _holds
    if _holds is None:
        _holds = parse(os.environ.get(ENV))
    return _holds


def _forget() -> None:
    global _holds
    _holds = None
    _taken.clear()


os.register_at_fork(after_in_child=_forget)  # a forked worker reads its own environment (worker_start.child_setup)


def before_task(worker: int) -> None:
    """Called by a worker for each task it takes, once it said `started` (builder/run/worker.py). Holds at the
    K-th (see above)."""
    mine = holds()
    if not mine:
        return
    _taken[worker] = n = _taken.get(worker, 0) + 1
    for k, folder in mine:
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


KILL_ENV = "HSBUILD_TEST_KILL_AFTER_RECORD"


def after_record(kind: str) -> None:
    """Called by a run once it has written a history record of `kind` and before the events it vouches for are
    emitted (builder/run/handling.py, `drop`). With HSBUILD_TEST_KILL_AFTER_RECORD=<kind> the process SIGKILLs
    itself there: the suite's crash between a durable record and its events' commit."""
    if os.environ.get(KILL_ENV) == kind:
        import signal  # noqa: PLC0415

        os.kill(os.getpid(), signal.SIGKILL)
