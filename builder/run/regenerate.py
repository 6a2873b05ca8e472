"""Regeneration's turn loop (a regenerating build, `hsbuild init --regenerate`; docs/regenerate.md), in one
place: a worker's backend wrapped so that one sample is one or more generation requests, one per assistant turn.

A sample's task carries its first prompt (its tokens) and its messages (extract/prompts.py). The loop sends the
first prompt as a `Generation` request; with `--turns all` and several turns, each earlier turn's generated
tokens are decoded to text, put in the conversation in place of the source's turn, and the next turn's prompt is
rendered from it with the chat template (`PromptTokenizer.prompt`); only the final request captures states. The
stored sample is that final request's prompt followed by its generated tokens exactly as the engine gave them
(`output_ids[:stored_output]`, never decoded and tokenized again), its loss mask 1 on them and, in the final
prompt, on the earlier regenerated turns (the template's assistant mask); 0 elsewhere. The states returned cover
exactly those tokens, or the sample fails `bad_states`.

Seeds: a sample's seed is mixed from the build's seed and its id (recorded in its `written` event), each turn's
from the sample's seed and the turn's number: a sample gives the same request each time it is generated (a
retry, a resume), and greedy or sampled alike, the same tokens from the same engine.
"""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from builder.config import BuildConfig, generation, generation_problem
from builder.extract import prompts
from builder.extract.backends.base import Failure, Generation, Outcome, Request, States

if TYPE_CHECKING:
    from builder.extract.backends.base import Backend
    from builder.extract.chat import PromptTokenizer


@dataclass(frozen=True)
class RegenSettings:
    """A regenerating build's generation settings, as its workers use them (WorkerSettings.regenerate)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    turns: str
    stop_ids: tuple[int, ...] = ()
    drop_truncated: bool = False  # a response that stopped at the token limit is retired, not written

    @classmethod
    def of(cls, cfg: BuildConfig, meta: dict) -> RegenSettings | None:
        """The build's (None: not a regenerating build). The stop ids are those init recorded."""
        g = generation(cfg)
        if g is None:
            return None
        return cls(**g, stop_ids=tuple(int(i) for i in meta.get("stop_ids") or ()),
                   drop_truncated=bool(cfg.drop_truncated))


def mix(*parts: object) -> int:
    """A seed (63 bits) from its parts, the same on every machine and Python (no `hash`)."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass(frozen=True)
class Regenerated:
    """A sample whose turns are all generated: what the worker stores, and what its `written` event records."""

    key: str
    input_ids: np.ndarray  # the final prompt + the stored generated tokens
    loss_mask: np.ndarray  # uint8
    aux: object  # torch.Tensor [n, n_aux * H]
    final: object  # torch.Tensor [n, H]
    detail: dict  # generated (the final turn's tokens), finish_reason, seed (the sample's), turns


@dataclass
class _Conversation:
    key: str
    messages: list[dict] | None
    targets: list[int]
    seed: int
    prompt: np.ndarray
    mask: np.ndarray
    turn: int = 0
    done: list[int] = field(default_factory=list)  # each earlier turn's generated tokens (counted only)


class TurnLoop:
    """The worker's backend as a regenerating build drives it (see the module's docstring): `start` a sample,
    `collect` its outcome once its final turn is generated (`Regenerated`, or the backend's `Failure` /
    `Unavailable`: an unavailable engine sends the sample back to pending, and it starts over from its first
    turn). The rest is the backend's."""

    def __init__(self, backend: Backend, tokenizer: PromptTokenizer, settings: RegenSettings):
        self.backend, self.tok, self.settings = backend, tokenizer, settings
        self._open: dict[str, _Conversation] = {}

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def capacity(self) -> int:
        return self.backend.capacity

    def in_flight(self) -> int:
        return self.backend.in_flight()

    def abandon_waiting(self) -> None:
        self.backend.abandon_waiting()

    def close(self) -> None:
        self._open.clear()
        self.backend.close()

    def start(self, key: str, prompt: np.ndarray, conversation: str | None) -> None:
        """Sample `key`: its first prompt's tokens (checked by the worker) and its messages."""
        s = self.settings
        messages = prompts.load(conversation) if conversation is not None else None
        targets = prompts.targets(messages, s.turns) if messages is not None else [0]
        conv = _Conversation(key, messages, targets, mix(s.seed, key),
                             np.asarray(prompt, dtype=np.int64), np.zeros(len(prompt), dtype=np.uint8))
        self._open[key] = conv
        self._submit(conv)

    def _submit(self, conv: _Conversation) -> None:
        s = self.settings
        last = conv.turn == len(conv.targets) - 1
        self.backend.submit(Request(conv.key, conv.prompt, generate=Generation(
            max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=mix(conv.seed, conv.turn),
            stop_ids=s.stop_ids, capture=last)))

    def collect(self, timeout: float) -> list[Outcome | Regenerated]:
        out: list[Outcome | Regenerated] = []
        for o in self.backend.collect(timeout):
            conv = self._open.get(o.key)
            if conv is None:
                continue
            if not isinstance(o, States):
                del self._open[o.key]
                out.append(o)
                continue
            if o.output_ids is None or o.finish_reason not in ("stop", "length") or not len(o.output_ids):
                del self._open[o.key]
                out.append(Failure(o.key, "bad_states", f"the {self.backend.name} backend returned no generated "
                                                        f"tokens or finish reason for a generation request"))
                continue
            if conv.turn + 1 < len(conv.targets):
                try:
                    self._next_turn(conv, o)
                except Exception as e:  # noqa: BLE001 - a template that refuses the conversation: this sample's
                    del self._open[o.key]
                    out.append(Failure(o.key, "error", f"turn {conv.turn + 2} of {len(conv.targets)}: "
                                       + traceback.format_exception_only(type(e), e)[-1].strip()))
                continue
            del self._open[o.key]
            out.append(self._stored(conv, o))
        return out

    def _next_turn(self, conv: _Conversation, o: States) -> None:
        """An earlier turn generated: its text in the conversation, the next turn's prompt rendered and sent."""
        ids = [int(t) for t in o.output_ids]
        while ids and ids[-1] in self.settings.stop_ids:
            ids.pop()
        conv.done.append(len(o.output_ids))
        conv.messages = prompts.answered(conv.messages, conv.targets[conv.turn], self.tok.decode(ids))
        conv.turn += 1
        prompt, mask = self.tok.prompt(conv.messages[: conv.targets[conv.turn]])
        conv.prompt = np.asarray(prompt, dtype=np.int64)
        conv.mask = np.asarray(mask, dtype=np.uint8)
        self._submit(conv)

    def _stored(self, conv: _Conversation, o: States) -> Regenerated | Failure:
        generated = np.asarray(o.output_ids, dtype=np.int64)
        kept = generated if o.stored_output is None else generated[: o.stored_output]
        ids = np.concatenate([conv.prompt, kept])
        if int(o.aux.shape[0]) != ids.shape[0] or int(o.final.shape[0]) != ids.shape[0]:
            return Failure(o.key, "bad_states", f"states for {int(o.aux.shape[0])} tokens, but the prompt and the "
                                                f"stored response hold {ids.shape[0]}")
        mask = np.concatenate([conv.mask, np.ones(kept.shape[0], dtype=np.uint8)])
        return Regenerated(o.key, ids, mask, o.aux, o.final, {
            "generated": int(generated.shape[0]), "finish_reason": o.finish_reason, "seed": conv.seed,
            "turns": len(conv.targets)})


# -- init ------------------------------------------------------------------------------------------------------
SHOW_ROWS = 5  # the rows an init error names at most


def check_init(cfg: BuildConfig, backend: str, ex: object) -> dict:
    """A regenerating build's checks at init (UsageError, nothing written): its generation flags, a backend that
    generates, a tokenizer with a chat template. Returns what its metadata records: `regenerate` and the
    settings, the stop ids (extract/spec.py `stop_ids`). {} for a build that does not regenerate (its flags
    refused when given)."""
    from builder.errors import UsageError  # noqa: PLC0415
    from builder.extract.backends import registry as backends  # noqa: PLC0415
    from builder.extract.spec import stop_ids  # noqa: PLC0415

    problem = generation_problem(cfg, flags=True)
    if problem is not None:
        raise UsageError(problem)
    g = generation(cfg)
    if g is None:
        return {}
    spec = backends.choose(backend)
    if not spec.generates:
        able = [s.name for s in backends.specs() if s.selectable and s.generates]
        raise UsageError(f"--regenerate: backend {backend} cannot generate; use --backend {' or '.join(able)}")
    refused = spec.generation_problem(g) if spec.generation_problem is not None else None
    if refused is not None:  # it generates, but not with these settings (an engine that generates greedily only)
        raise UsageError(refused)
    tok = getattr(ex, "tokenizer", None)
    if tok is None or not getattr(tok, "has_chat_template", lambda: False)():
        raise UsageError(f"--regenerate: the tokenizer of --model {cfg.model} has no chat template, so a "
                         "conversation cannot be rendered as a prompt; give a chat model (its tokenizer_config.json "
                         "holds chat_template)")
    return {"regenerate": True, **g, "drop_truncated": bool(cfg.drop_truncated),
            "stop_ids": list(stop_ids(cfg.model, tok))}


def check_prompts(samples, limit: int, source: object) -> None:  # noqa: ANN001 - (SourceSamples)
    """Refuse (UsageError naming the rows) first prompts that leave no position to generate in: the model's
    context, or --max-tokens where that is less. Never a silent cut."""
    from builder.errors import UsageError  # noqa: PLC0415

    lengths = np.asarray(samples.num_tokens)
    over = np.flatnonzero(lengths >= limit)
    if not over.size:
        return
    named = ", ".join(f"row {int(samples.rows[i])} (id {samples[int(i)].sample_id}, {int(lengths[i])} tokens)"
                      for i in over[:SHOW_ROWS])
    more = f" and {over.size - SHOW_ROWS} more" if over.size > SHOW_ROWS else ""
    raise UsageError(f"{source}: {over.size} prompt(s) leave no room to generate within {limit} positions (the "
                     f"model's context, or --max-tokens): {named}{more} (rows count from 0); shorten or drop them")
