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
class Generation:
    """Generate after the request's input_ids (the prompt), then return the states of prompt + generated
    (`hsbuild init --regenerate`; only a backend whose spec says `generates` is given one)."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    seed: int = 0  # this request's own seed (the build's seed mixed with the sample id and turn)
    stop_ids: tuple[int, ...] = ()  # token ids that end the response (eos / end of turn), included in output
    capture: bool = True  # False: an earlier turn of --turns all: only output_ids are needed, no states


@dataclass(frozen=True)
class Request:
    key: str  # the sample id
    input_ids: np.ndarray  # int64 [n], already checked against the model (vocabulary, positions)
    origin: str | None = None  # import: the dump file holding this sample's states
    generate: Generation | None = None  # None: a plain forward pass over input_ids (every build but --regenerate)


@dataclass(frozen=True)
class States:
    key: str
    aux: torch.Tensor  # [n, n_aux * H], the model dtype, CPU: the STORED tokens (input_ids + stored output)
    final: torch.Tensor  # [n, H], the build's final-state convention (pre_norm or post_norm)
    output_ids: np.ndarray | None = None  # a Generation: the generated tokens, exactly as the engine produced them
    finish_reason: str | None = None  # a Generation: "stop" (a stop id, the engine's eos) | "length" (max_new_tokens
    # or the model's context reached)
    stored_output: int | None = None  # how many of output_ids the states cover (in-process: all; an engine that
    # never feeds the last token back: all but that one); None: all


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
