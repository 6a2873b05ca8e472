"""An export's sample files written side by side (builder/exchange/export_reconcile.py, step 3 of the write order in
docs/design.md): what makes a file-per-sample export run at the filesystem's speed.

Each file still goes through `export_files.write_file` (temp name, write, fsync, rename: under its final name a
file is whole), on one of a few threads: `os.write`, `os.fsync` and the CRC-32C let go of the GIL, and a filesystem
that journals (ext4, xfs) commits the fsyncs of files written side by side together, so N writers pay about one
journal commit where one writer pays N. The journal of the export still vouches for a file only once its write
has returned (the file fsynced and renamed) and the folders it was renamed into are fsynced (`Reconcile.save`):
the same durability as one file at a time, batched. Files come back in the order they were given, so the report
and the journal list them as a one-at-a-time export would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from builder.exchange.export_files import digest, write_file, write_streamed
from builder.formats.base import Streamed

THREADS = 8  # files written at once
IN_FLIGHT = 4 * THREADS  # files handed over and not yet back, at most
IN_FLIGHT_BYTES = 512 << 20  # ... and about this many bytes (one file, however big, always goes)


def size_of(data: bytes | Streamed) -> int:
    """The bytes a file will take: its length, or at most a `Streamed`'s bound."""
    return data.size if isinstance(data, Streamed) else len(data)


@dataclass
class Written:
    """One file handed to the writers (`key`: the caller's) and the bytes it counts for while in flight (`bound`),
    and once back: its checksum (export_files.digest) and size."""

    key: object
    rel: str
    bound: int
    size: int = 0
    sum: str = ""


class Writers:
    """Files written on THREADS threads, at most IN_FLIGHT (and about IN_FLIGHT_BYTES) at once; `done` is called
    with each file whose write returned, in the order the files were given, from the caller's thread."""

    def __init__(self, out: Path, done: Callable[[Written], None]):
        self.out = out
        self.done = done
        self.pool: ThreadPoolExecutor | None = None
        self.queue: deque[tuple[Written, Future]] = deque()
        self.pending_bytes = 0

    def pending_paths(self) -> set[str]:
        return {w.rel for w, _ in self.queue}

    def submit(self, key: object, rel: str, data: bytes | Streamed) -> None:
        """Hand over one file, its bytes or a `Streamed` that writes them (waiting while too many are in flight);
        raises the first failed write (OSError)."""
        bound = size_of(data)
        while self.queue and (len(self.queue) >= IN_FLIGHT or self.pending_bytes + bound > IN_FLIGHT_BYTES):
            self._finish_one()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="hsbuild-export")
        w = Written(key, rel, bound)
        self.queue.append((w, self.pool.submit(self._write, self.out / rel, data)))
        self.pending_bytes += bound
        self.collect()

    @staticmethod
    def _write(path: Path, data: bytes | Streamed) -> tuple[str, int]:
        if isinstance(data, Streamed):
            return write_streamed(path, data)
        write_file(path, data)
        return digest(data), len(data)

    def collect(self) -> None:
        """Take back the files whose writes returned (in order, up to the first still running)."""
        while self.queue and self.queue[0][1].done():
            self._finish_one()

    def _finish_one(self) -> None:
        w, fut = self.queue.popleft()
        self.pending_bytes -= w.bound
        w.sum, w.size = fut.result()  # (a failed write raises here: its temp file is gone, nothing vouched for)
        self.done(w)

    def drain(self) -> None:
        """Wait for every file in flight; raises the first failed write once all have returned (every file that
        was written is passed to `done`, those after a failure too)."""
        first: BaseException | None = None
        while self.queue:
            try:
                self._finish_one()
            except Exception as e:  # noqa: BLE001 - kept, raised once the others are back
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for every write in flight (after an error: their files are not vouched for, and the next run
        removes them as files the journal does not vouch for) and stop the threads."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        self.queue.clear()
        self.pending_bytes = 0
