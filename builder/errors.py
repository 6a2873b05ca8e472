"""Domain exceptions. The library raises these; only the CLI turns them into messages and exit codes.

Each class also subclasses the stdlib type a caller would naturally catch (zarr-python's style).
"""

from __future__ import annotations

import errno

# Exit codes (documented in README.md and docs/design.md).
EXIT_OK = 0
EXIT_SAMPLES_FAILED = 1  # finished, but some samples failed (run) / damage found (verify)
EXIT_USAGE = 2  # usage error or bad input; nothing committed changed
EXIT_WONT_FIT = 3  # projected build size does not fit below the high watermark, the volume is full or stalled,
# or the staging volume is smaller than one sample's staging file
EXIT_PREFLIGHT = 4  # a blocking preflight (doctor) problem; a server or dump that is not the build's; no cluster
EXIT_BUSY = 5  # another live process owns the build (a run, a verify sweep, an export): try again when it ends
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

    exit_code = EXIT_BUSY


class BuildReadOnlyError(UsageError, PermissionError):
    """The build cannot be written (no write permission, or a read-only mount): it cannot be locked."""


class ConfigChangedError(UsageError):
    """hsbuild.toml changes what samples look like (format keys) since `init`: never mixed, never overridable."""


class ForeignLockError(BuildLockedError):
    """The lock file names an owner on another host that never released it (flock cannot see across hosts on
    many network filesystems): refused unless the caller takes over explicitly (`--take-over`)."""


class LogDamagedError(UsageError, OSError):
    """The event log cannot be opened or read (garbage, truncated, a WAL that does not match): names the
    recovery, `hsbuild rebuild-log BUILD`."""


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


class FormatError(UsageError):
    """A trainer format cannot be produced from (or imported into) this build, or a flag of export/import is wrong."""


class SampleError(HsbuildError, ValueError):
    """A per-sample problem (bad tokens, non-finite states, ...): becomes a `failed` event with `reason`, and the
    run goes on."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class DamagedSampleError(HsbuildError, IOError):
    """A committed sample's stored bytes are not what its `written` event recorded: a chunk file is missing, does
    not decode, or decodes to bytes whose CRC-32C differs. Names the sample, segment, field and the repair.

    `reason` is the verify reason: `missing_data`, `unreadable` or `checksum_mismatch`."""

    exit_code = EXIT_SAMPLES_FAILED

    def __init__(self, reason: str, problem: str, *, segment: str, field: str | None = None,
                 sample_id: str | None = None, build: str | None = None):
        self.reason, self.problem, self.segment, self.field = reason, problem, segment, field
        self.sample_id, self.build = sample_id, build
        super().__init__(self._message())

    def _message(self) -> str:
        who = f"sample {self.sample_id}" if self.sample_id is not None else "sample"
        where = f"segment {self.segment}" + (f", field {self.field}" if self.field else "")
        b = self.build or "BUILD"
        return (f"{who} is damaged ({where}): {self.problem} [{self.reason}]; "
                f"repair: hsbuild verify {b}, then hsbuild resume {b}")

    def with_context(self, sample_id: str | None = None, build: str | None = None) -> DamagedSampleError:
        """The same error naming the sample and build (the store layer knows neither)."""
        return DamagedSampleError(self.reason, self.problem, segment=self.segment, field=self.field,
                                  sample_id=sample_id if sample_id is not None else self.sample_id,
                                  build=build if build is not None else self.build)

    def __reduce__(self):  # picklable with its fields (DataLoader workers, multiprocessing)
        return (_rebuild_damaged, (self.reason, self.problem, self.segment, self.field, self.sample_id, self.build))


def _rebuild_damaged(reason, problem, segment, field, sample_id, build) -> DamagedSampleError:
    return DamagedSampleError(reason, problem, segment=segment, field=field, sample_id=sample_id, build=build)


class StorageStalledError(HsbuildError, TimeoutError):
    """The build's volume does not answer: a read (or a write probe) of it did not return within HSBUILD_STALL_S
    (a full Ceph pool or thin volume, a gone NFS server, a failing disk). Nothing was read or changed."""

    exit_code = EXIT_WONT_FIT


class WontFitError(HsbuildError, OSError):
    """The projected size of the build does not fit on its volume above the high watermark."""

    exit_code = EXIT_WONT_FIT


class PreflightError(HsbuildError, RuntimeError):
    """A blocking preflight problem (see `hsbuild doctor`)."""

    exit_code = EXIT_PREFLIGHT


class ClusterUnreachableError(HsbuildError, ConnectionError):
    """`--ray ADDRESS`: no Ray cluster answers there (within a bound, never an endless retry)."""

    exit_code = EXIT_PREFLIGHT


class Interrupted(HsbuildError, KeyboardInterrupt):
    """The run stopped on request at a safe point."""

    exit_code = EXIT_INTERRUPTED


def is_no_space(e: BaseException) -> bool:
    """An error caused by a full volume (or quota), from the OS or from DuckDB: the one rule for "is this out of
    space" (a write that fails so is retried once there is room, never counted against a sample)."""
    if isinstance(e, DiskFullError):
        return True
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(e)
    return "No space left on device" in msg or "Disk quota exceeded" in msg
