"""Messages between the coordinator and its workers, one small dataclass each (sent pickled over each worker's
own pipe).

Coordinator -> worker: `Task` (extract and write one sample), `Stop` (no more tasks: seal and exit).
Worker -> coordinator: everything else; each names its worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from builder.store.segment import Location


# -- coordinator -> worker ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    sample_id: str
    attempt: int
    fingerprint: str
    input_ids: object  # np.ndarray int32
    loss_mask: object  # np.ndarray uint8
    origin: str | None = None  # import: the dump file to take the states from instead of a forward pass
    conversation: str | None = None  # a regenerating build: its messages (input_ids: its first prompt)


@dataclass(frozen=True)
class Stop:
    """No more tasks: finish, seal the segment, say `Exit`."""


# -- worker -> coordinator ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The model is loaded."""

    worker: int
    fingerprint: str
    metadata: dict
    capacity: int = 1  # requests its backend keeps in flight (the coordinator hands it that many and more)
    device: str = ""  # where its forward passes run (in-process backend), e.g. cuda:3


@dataclass(frozen=True)
class Fatal:
    """The worker could not start (the model failed to load)."""

    worker: int
    error: str


@dataclass(frozen=True)
class Started:
    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    at: float  # time.time()


@dataclass(frozen=True)
class Staged:
    """Extracted and staged in the worker's current group (in memory, not durable yet): the coordinator may hand
    the worker its next sample. `Written` (or `NoSpace`/`Abandoned`/`Failed`) follows when the group is flushed."""

    worker: int
    sample_id: str


@dataclass(frozen=True)
class Written:
    """The sample is durable at `location`."""

    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    location: Location
    truncated: int  # tokens cut by max_tokens
    seconds: float
    verified: bool  # read back and checked (--verify-after-write)
    check_error: str | None = None  # --verify-after-write could not read it back (EIO, EMFILE, ...): not checked
    generation: dict | None = None  # a regenerated sample: generated, finish_reason, seed, turns


@dataclass(frozen=True)
class Dropped:
    """A regenerated response that stopped at the token limit, not written (--drop-truncated): it is retired."""

    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    generation: dict  # generated, finish_reason, seed, turns


@dataclass(frozen=True)
class Failed:
    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    reason: str
    message: str


@dataclass(frozen=True)
class NoSpace:
    """The filesystem said ENOSPC/EDQUOT; what was written of the sample is removed."""

    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    message: str


@dataclass(frozen=True)
class Deferred:
    """Not written: it would have crossed `flood` (or gone below `min_free`)."""

    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    projected: int  # bytes the write would take (uncompressed upper bound)
    total: int  # the data volume's size and free bytes the worker measured (statvfs)
    free: int


@dataclass(frozen=True)
class Unreachable:
    """The engine could not serve it (connection refused, timed out, died mid-write): back to pending, not
    counted against --max-attempts; the run pauses (`server_unavailable`) until the engine is healthy."""

    worker: int
    sample_id: str
    attempt: int
    fingerprint: str
    message: str
    refused: bool = False  # the server that came back is not the build's (another model, other layers): stop
    need_bytes: int = 0  # > 0: the staging volume is full (ENOSPC); the run pauses until it has this much free
    too_small: bool = False  # the staging volume cannot hold the sample's file even when empty: the run stops


@dataclass(frozen=True)
class ServerChecked:
    """The server came back and was checked again (its command line, /v1/models, a probe): it is the build's."""

    worker: int
    found: dict


@dataclass(frozen=True)
class Skipped:
    """Not started: the run is stopping."""

    worker: int
    sample_id: str


@dataclass(frozen=True)
class Abandoned:
    """Extracted but not written: the run stopped while writers were paused."""

    worker: int
    sample_id: str


@dataclass(frozen=True)
class Sealed:
    worker: int
    info: dict  # seal.json: segment, tokens, samples, sealed_at, chunk_tokens


@dataclass(frozen=True)
class SealFailed:
    worker: int
    segment: str
    error: str


@dataclass(frozen=True)
class Exit:
    """The worker's last message: it is about to exit cleanly."""

    worker: int


ToWorker = Task | Stop
FromWorker = (Ready | Fatal | Started | Staged | Written | Dropped | Failed | NoSpace | Deferred | Unreachable
              | ServerChecked | Skipped | Abandoned | Sealed | SealFailed | Exit)


@dataclass
class WorkerSettings:
    """Everything a worker needs (the first message to it: builder/run/worker.py)."""

    build_root: str
    data_root: str
    run_id: str
    worker: int
    model: str
    aux_layers: list[int]
    dtype: str
    device: str
    codec: str
    chunk_tokens: int
    max_tokens: int | None
    threads: int
    backend: str  # the backend the worker opens (builder/extract/backends/registry.py) ...
    verify_after_write: bool = False
    flood: float = 0.95
    coordinator_pid: int = 0
    min_free: int = 0
    final_state: str = "post_norm"
    backend_settings: object | None = None  # ... with these settings (its spec's `worker_settings`), if any
    server_check: object | None = None  # the engine's ServerIdentity (extract.backends.serving): run when the
    # server comes back
    final_norm: str | None = None  # the build's final_norm.safetensors (post-norm states from an engine)
    batch_tokens: int | None = None  # in-process: pack samples into forward passes of up to this many tokens
    quantize: str = "none"  # fp8: states stored as float8_e4m3fn with a float32 scale a token
    history_ordinal: int = 0  # the run's ordinal in the build's history (data/history/): its record precedes
    # the worker's segment (SegmentWriter.run_record)
    regenerate: object | None = None  # a regenerating build: its run.regenerate.RegenSettings (the turn loop)
