"""The backend interface: what a worker needs from whatever runs the forward passes.

A worker `submit`s up to `capacity` requests and `collect`s their outcomes, in any order. An in-process model
has capacity 1 and computes in `collect`; an inference server keeps `capacity` requests in flight so that the
engine batches them while the worker writes. Outcomes are typed: states, a per-sample failure (counts as an
attempt), or `Unavailable` (the engine is gone: the sample goes back to pending, not counted against
--max-attempts). Adding an engine (SGLang next) means one plug-in, a module or a package, registered with its
spec (registry.py; an engine whose model a server runs gives its server's hooks too: serving.py), nothing in the
run loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (a backend module is read without torch: builder/extract/backends/registry.py)
    import numpy as np
    import torch


@dataclass(frozen=True)
class Request:
    key: str  # the sample id
    input_ids: np.ndarray  # int64 [n], already checked against the model (vocabulary, positions)
    origin: str | None = None  # import: the dump file holding this sample's states


@dataclass(frozen=True)
class States:
    key: str
    aux: torch.Tensor  # [n, n_aux * H], the model dtype, CPU
    final: torch.Tensor  # [n, H], the build's final-state convention (pre_norm or post_norm)


@dataclass(frozen=True)
class Failure:
    key: str
    reason: str  # nonfinite, token_mismatch, bad_states, error, ...
    message: str


@dataclass(frozen=True)
class Unavailable:
    key: str
    message: str  # why the engine could not serve it (connection refused, timeout, server died)
    refused: bool = False  # the server is not the build's (another model, other layers): the run must stop
    need_bytes: int = 0  # > 0: the staging volume is full; requests wait until it has this many bytes free
    too_small: bool = False  # the staging volume cannot hold this sample's file even when empty: the run must stop


Outcome = States | Failure | Unavailable


class Backend(Protocol):
    """What the worker loop uses. Implementations never print and never touch the build."""

    name: str
    capacity: int  # requests that may be in flight at once

    def submit(self, request: Request) -> None: ...

    def collect(self, timeout: float) -> list[Outcome]:
        """Outcomes ready now, waiting up to `timeout` seconds for the first one."""
        ...

    def in_flight(self) -> int: ...

    def abandon_waiting(self) -> None:
        """The run is stopping: give up requests that wait for an unavailable engine."""
        ...

    def close(self) -> None: ...


def check_finite(key: str, aux: torch.Tensor, final: torch.Tensor) -> Failure | None:
    import torch  # noqa: PLC0415 - (imported by then: the states are tensors)

    for name, t in (("aux_hidden_state", aux), ("hidden_state", final)):
        # a sum is finite only where every term is (NaN and Inf propagate): one vectorized pass, about 10x
        # quicker than an elementwise isfinite; a non-finite sum (also an overflow of large finite values) is
        # then looked at element by element
        if t.numel() and bool(torch.isfinite(t.sum(dtype=torch.float32))):
            continue
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).any(dim=-1).nonzero()[0, 0])
            return Failure(key, "nonfinite", f"{name} holds NaN/Inf (first at token {bad})")
    return None
