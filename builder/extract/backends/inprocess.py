"""The in-process backend: the worker's own copy of the model (builtin or a local Hugging Face directory).
Capacity 1: `collect` runs the forward pass of the one request submitted."""

from __future__ import annotations

import traceback

from builder.errors import SampleError
from builder.extract.backends.base import Failure, Outcome, Request, States
from builder.extract.model import Extractor


class InProcessBackend:
    name = "inprocess"
    capacity = 1

    def __init__(self, extractor: Extractor):
        self.ex = extractor
        self._pending: list[Request] = []

    def submit(self, request: Request) -> None:
        self._pending.append(request)

    def collect(self, timeout: float) -> list[Outcome]:
        out: list[Outcome] = []
        while self._pending:
            r = self._pending.pop(0)
            try:
                aux, final = self.ex.extract(r.input_ids)
                out.append(States(r.key, aux, final))
            except SampleError as e:
                out.append(Failure(r.key, e.reason, str(e)))
            except Exception as e:  # noqa: BLE001 - one bad sample must not end the run
                out.append(Failure(r.key, "error", traceback.format_exception_only(type(e), e)[-1].strip()))
        return out

    def in_flight(self) -> int:
        return len(self._pending)

    def abandon_waiting(self) -> None:
        pass  # nothing waits: collect computes

    def close(self) -> None:
        self._pending.clear()
