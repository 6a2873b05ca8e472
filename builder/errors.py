"""Domain exceptions. The library raises these; only the CLI turns them into messages and exit codes.

Each class also subclasses the stdlib type a caller would naturally catch (zarr-python's style).
"""

from __future__ import annotations

# Exit codes (documented in README.md and docs/design.md).
EXIT_OK = 0
EXIT_SAMPLES_FAILED = 1  # finished, but some samples failed (run) / damage found (verify)
EXIT_USAGE = 2  # usage error or bad input; nothing committed changed
EXIT_WONT_FIT = 3  # projected build size does not fit below the high watermark, or the volume is full
EXIT_PREFLIGHT = 4  # a blocking preflight (doctor) problem
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM; everything committed is safe


class HsbuildError(Exception):
    """Base class of every hsbuild error."""

    exit_code = EXIT_USAGE


class UsageError(HsbuildError, ValueError):
    """A bad flag, argument or configuration value."""


class SourceError(UsageError):
    """The source file is missing or malformed. Names the file, line and field."""

    def __init__(self, path: str, message: str, line: int | None = None, field: str | None = None):
        self.path, self.line, self.field = str(path), line, field
        where = self.path + (f":{line}" if line is not None else "")
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


class SourceChangedError(UsageError):
    """The source no longer matches the samples registered in the build."""


class BuildExistsError(UsageError, FileExistsError):
    """`init` on a directory that already holds a build."""


class BuildNotFoundError(UsageError, FileNotFoundError):
    """The directory is not an hsbuild build."""


class BuildLockedError(HsbuildError, BlockingIOError):
    """Another live process owns the build (a run or verify is going)."""


class ForeignLockError(BuildLockedError):
    """The lock file names an owner on another host that never released it (flock cannot see across hosts on
    many network filesystems): refused unless the caller takes over explicitly (`--take-over`)."""


class LogConflictError(HsbuildError, RuntimeError):
    """Another process appended to the event log under its owner: two writers, which the lock should prevent
    (e.g. a network filesystem whose locks are local to each host)."""


class DiskFullError(HsbuildError, OSError):
    """The volume holding the build is full: the event log (or the lock record) cannot be written. Nothing
    committed is lost; free space and run the command again (`hsbuild resume` continues a run)."""

    exit_code = EXIT_WONT_FIT


class ReadOnlyQueryError(UsageError, PermissionError):
    """`hsbuild sql` refused a statement that would write."""


class QueryError(UsageError):
    """The SQL failed to parse or run."""


class ModelError(UsageError):
    """The model spec or model directory is unusable."""


class SampleError(HsbuildError, ValueError):
    """A per-sample problem (bad tokens, non-finite states, ...): becomes a `failed` event with `reason`, and the
    run goes on."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class WontFitError(HsbuildError, OSError):
    """The projected size of the build does not fit on its volume above the high watermark."""

    exit_code = EXIT_WONT_FIT


class PreflightError(HsbuildError, RuntimeError):
    """A blocking preflight problem (see `hsbuild doctor`)."""

    exit_code = EXIT_PREFLIGHT


class Interrupted(HsbuildError, KeyboardInterrupt):
    """The run stopped on request at a safe point."""

    exit_code = EXIT_INTERRUPTED
