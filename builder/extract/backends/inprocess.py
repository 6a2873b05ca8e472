"""The in-process backend: the worker's own copy of the model (builtin or a local Hugging Face directory).

One at a time (the default): capacity 1, and `collect` runs the forward pass of the one request submitted.
Batched (`batch_tokens`): the worker keeps up to `capacity` requests submitted, and each `collect` runs one
packed forward pass over the oldest of them, at most BATCH_SAMPLES samples and `batch_tokens` tokens (a longer
sample goes alone). Every sample gets the states its lone pass gives it, bit for bit (Extractor.extract_batch),
and fails alone.

A generation request (`Request.generate`, a regenerating build) is generated with a KV cache, its states captured
as it generates (builder/extract/generation.py); its positions are the model's context, or the build's
--max-tokens where that is less. One at a time it runs alone; batched, up to BATCH_SAMPLES generation requests
(their prompts within `batch_tokens`) are decoded together, each one's tokens and states those it gets alone, bit
for bit (builder/extract/generation_batch.py)."""

from __future__ import annotations

import traceback
from collections import deque
from typing import TYPE_CHECKING

from builder.errors import SampleError
from builder.extract.backends.base import Failure, Outcome, Request, States
from builder.extract.backends.registry import BackendSpec, register

if TYPE_CHECKING:
    from builder.extract.model import Extractor

BATCH_SAMPLES = 32  # samples in one packed forward pass at most
SAMPLE_TOKENS = 32  # the requests a worker keeps: two batches of samples this short (at most 2 x BATCH_SAMPLES)


class InProcessBackend:
    name = "inprocess"

    def __init__(self, extractor: Extractor, batch_tokens: int | None = None, max_tokens: int | None = None):
        self.ex = extractor
        self.limit = min(extractor.max_positions, max_tokens or extractor.max_positions)  # a generation's positions
        self.batch_tokens = batch_tokens if batch_tokens and batch_tokens > 0 else None
        self._pending: deque[Request] = deque()
        self._pending_tokens = 0
        self._fresh = False  # a request came since the last `collect`: more may be on their way

    @property
    def capacity(self) -> int:
        """Requests the worker may keep submitted (and the coordinator hands it that many and one more): one;
        batched, two batches' worth (one computing, the next gathering while its outcomes are staged), in
        samples of SAMPLE_TOKENS and, while they wait, in tokens."""
        if self.batch_tokens is None:
            return 1
        if self._pending_tokens >= 2 * self.batch_tokens:
            return len(self._pending)  # full: no more until a batch is done
        return min(2 * BATCH_SAMPLES, max(2, 2 * self.batch_tokens // SAMPLE_TOKENS))

    def submit(self, request: Request) -> None:
        self._pending.append(request)
        self._pending_tokens += int(request.input_ids.shape[0])
        self._fresh = True

    def _next_batch(self) -> tuple[int, bool]:
        """How many of the oldest requests the next pass takes, and whether that batch is full (a bound, not
        the end of what is pending, ended it). Generation requests are batched among themselves, plain forward
        passes among themselves: a batch ends before a request of the other kind."""
        if self.batch_tokens is None:
            return len(self._pending), True  # one at a time: whatever was submitted, each in its own pass
        kind = self._pending[0].generate is not None
        count = tokens = 0
        for r in self._pending:
            n = int(r.input_ids.shape[0])
            if (r.generate is not None) != kind:
                return count, True  # (the batch ends before it)
            if count == BATCH_SAMPLES or (count and tokens + n > self.batch_tokens):
                return count, True
            count, tokens = count + 1, tokens + n
        return count, count == BATCH_SAMPLES or tokens >= self.batch_tokens

    def collect(self, timeout: float) -> list[Outcome]:
        """Runs the next forward pass. Batched, a batch that is not full waits while requests keep coming:
        `collect(0)` right after a `submit` returns nothing; a later call, or one with a timeout, runs it."""
        if not self._pending:
            return []
        count, full = self._next_batch()
        fresh, self._fresh = self._fresh, False
        if not full and timeout <= 0 and fresh:
            return []
        batch = [self._pending.popleft() for _ in range(count)]
        self._pending_tokens -= sum(int(r.input_ids.shape[0]) for r in batch)
        if self.batch_tokens is None or len(batch) == 1:
            results = [self._one(r) for r in batch]
        else:
            try:
                results = (self.ex.generate_batch([(r.input_ids, r.generate) for r in batch], self.limit)
                           if batch[0].generate is not None else self.ex.extract_batch([r.input_ids for r in batch]))
            except Exception:  # noqa: BLE001 - a batched pass that raises (out of memory where a lone one fits):
                results = [self._one(r) for r in batch]  # each sample alone, its own outcome or its own error
        return [_outcome(r.key, res) for r, res in zip(batch, results, strict=True)]

    def _one(self, r: Request):
        try:
            if r.generate is not None:
                return self.ex.generate(r.input_ids, r.generate, self.limit)
            return self.ex.extract(r.input_ids)
        except Exception as e:  # noqa: BLE001 - one bad sample must not end the run
            return e

    def in_flight(self) -> int:
        return len(self._pending)

    def abandon_waiting(self) -> None:
        pass  # nothing waits: collect computes

    def close(self) -> None:
        self._pending.clear()
        self._pending_tokens = 0


def _outcome(key: str, result) -> Outcome:
    if isinstance(result, SampleError):
        return Failure(key, result.reason, str(result))
    if isinstance(result, Exception):
        return Failure(key, "error", traceback.format_exception_only(type(result), result)[-1].strip())
    if isinstance(result, tuple):
        aux, final = result
        return States(key, aux, final)
    if result.aux is None:  # (an earlier turn: no states kept)
        import torch  # noqa: PLC0415 - (imported by then)

        result.aux, result.final = torch.empty(0), torch.empty(0)
    return States(key, result.aux, result.final, output_ids=result.output_ids, finish_reason=result.finish_reason)


def _open(settings, recheck=None):  # noqa: ANN001, ARG001 - (WorkerSettings; no server to check)
    """The worker's own copy of the model, on its device (`--device auto`: one GPU a worker, round robin)."""
    import torch  # noqa: PLC0415

    from builder.extract.model import Extractor, spread_device  # noqa: PLC0415

    gpus = torch.cuda.device_count() if settings.device in ("auto", "cuda") and torch.cuda.is_available() else 0
    ex = Extractor(settings.model, settings.aux_layers or None, settings.dtype,
                   spread_device(settings.device, settings.worker, gpus), final_state=settings.final_state)
    return ex, InProcessBackend(ex, settings.batch_tokens, settings.max_tokens)


BACKEND = register(BackendSpec(
    name="inprocess", summary="the workers load the model", open=_open, loads_model=True,
    options={"batch_tokens": None}, generates=True))
