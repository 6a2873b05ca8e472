"""Generation in-process (a regenerating build: `Request.generate`), with a KV cache, the states of every stored
token captured on the way: one pass, no second prefill.

The prompt's forward pass (the prefill) gives the prompt's states and the first token's logits; each generated
token is then fed once, with the cache, and that step gives its states and the next token's logits. The last
generated token is fed once more (a one-token step) only for its states: every generated token is stored with
its state. An earlier turn of `--turns all` (`capture` False) keeps no states and skips that step.

Sampling: greedy (argmax) at temperature 0; else softmax(logits / temperature), cut to the top_p nucleus, drawn
with a `torch.Generator` seeded with the request's own seed, so a request gives the same tokens each time. The
built-in model's logits come from its random head (BuiltinLlama.lm_head), a Hugging Face model's from its own
(`logits_to_keep=1`, as transformers' `generate` asks them); both in float32 before sampling.

A response ends at a stop id (`finish_reason` "stop", the stop id included), at max_new_tokens or where prompt
and response fill `limit` positions (the model's context, or the build's --max-tokens): "length"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from builder.errors import SampleError
from builder.extract.backends.base import Generation, check_finite
from builder.extract.builtin_model import _rope

if TYPE_CHECKING:
    from builder.extract.model import Extractor


@dataclass
class Generated:
    output_ids: np.ndarray  # int64: the generated tokens, as sampled
    finish_reason: str  # "stop" | "length"
    aux: torch.Tensor | None = None  # [prompt + generated, n_aux * H] on the CPU (capture), else None
    final: torch.Tensor | None = None


def pick(logits: torch.Tensor, gen: Generation, rng: torch.Generator) -> int:
    """The next token from one position's logits (float32 [V]): argmax, or a draw (temperature, top_p)."""
    if gen.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / gen.temperature, dim=-1)
    if gen.top_p < 1.0:
        p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(p, dim=-1) - p < gen.top_p  # the smallest prefix whose mass reaches top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=rng))


def _keep(ex: Extractor, states, pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """One step's states as stored: (aux [n, n_aux * H], final [n, H]), as `Extractor.extract` takes them."""
    aux = torch.cat([states[i][0] for i in ex.aux_layers], dim=-1)
    final = pre[0] if ex.final_state == "pre_norm" else states[ex.num_layers][0]
    return aux, final


class _BuiltinSteps:
    """The built-in model fed with a KV cache: one step is a forward pass over new tokens after those cached."""

    def __init__(self, ex: Extractor, limit: int):
        self.ex, self.model = ex, ex._model
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.model.layers)
        self.pos = 0
        like = self.model.embed_tokens.weight
        self.cos, self.sin = self.model.rope_tables(limit, like)  # each position's values as `forward` makes them

    def step(self, ids: torch.Tensor, logits: bool = True, keep: bool = True):
        m, n, start = self.model, ids.shape[1], self.pos
        x = m.embed_tokens(ids)
        cos, sin = self.cos[start:start + n], self.sin[start:start + n]
        states = [x]
        for i, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            b = h.shape[0]
            q = layer.q_proj(h).view(b, n, layer.heads, layer.head_dim).transpose(1, 2)
            k = layer.k_proj(h).view(b, n, layer.kv_heads, layer.head_dim).transpose(1, 2)
            v = layer.v_proj(h).view(b, n, layer.kv_heads, layer.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if self.cache[i] is not None:
                k, v = torch.cat((self.cache[i][0], k), dim=2), torch.cat((self.cache[i][1], v), dim=2)
            self.cache[i] = (k, v)
            rep = layer.heads // layer.kv_heads
            kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            # the prefill is causal; a one-token step attends to everything cached (a causal mask on a [1, T] score
            # row would keep only the first position)
            att = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=start == 0 and n > 1)
            x = x + layer.o_proj(att.transpose(1, 2).reshape(b, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            states.append(x)
        pre = x
        states[-1] = m.norm(x)
        self.pos += n
        out = (states[-1][0, -1].float() @ m.lm_head.float().T) if logits else None
        return out, (_keep(self.ex, states, pre) if keep else None)


class _HfSteps:
    """A Hugging Face model fed with its own cache (`past_key_values`), its hidden states asked at each step."""

    def __init__(self, ex: Extractor, limit: int):  # noqa: ARG002 - (the model knows its positions)
        self.ex, self.model = ex, ex._model
        self.cache = None

    def step(self, ids: torch.Tensor, logits: bool = True, keep: bool = True):
        self.ex._pre.clear()
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, output_hidden_states=keep,
                         logits_to_keep=1)
        self.cache = out.past_key_values
        pre = self.ex._pre.pop() if self.ex._pre else None
        self.ex._pre.clear()
        return (out.logits[0, -1].float() if logits else None), (_keep(self.ex, out.hidden_states, pre) if keep
                                                                  else None)


def start(ex: Extractor, input_ids: np.ndarray, gen: Generation, limit: int):  # noqa: ANN201
    """A generation's prefill: (room: the tokens it may generate, its steps (with their cache), its generator, the
    first token's logits, the prompt's states or None). Raises SampleError `too_long` when the prompt leaves no
    position to generate in."""
    n = int(input_ids.shape[0])
    room = min(gen.max_new_tokens, limit - n)
    if room < 1:
        raise SampleError("too_long", f"the prompt's {n} tokens leave no room to generate in {limit} positions "
                                      "(the model's context, or --max-tokens)")
    steps = _HfSteps(ex, limit) if ex._hf else _BuiltinSteps(ex, limit)
    rng = torch.Generator(device="cpu").manual_seed(int(gen.seed))
    ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).unsqueeze(0).to(ex.device)
    logits, kept = steps.step(ids, keep=gen.capture)
    return room, steps, rng, logits, kept


def finish(out: list[int], reason: str, parts: list | None) -> Generated:
    """The generation's result: its tokens, and with `parts` (each step's kept states) its states, checked finite
    (SampleError `nonfinite`)."""
    result = Generated(np.asarray(out, dtype=np.int64), reason)
    if parts is not None:
        aux = torch.cat([a for a, _ in parts], dim=0)
        final = torch.cat([f for _, f in parts], dim=0)
        bad = check_finite("", aux, final)
        if bad is not None:
            raise SampleError(bad.reason, bad.message)
        result.aux, result.final = aux.to("cpu"), final.to("cpu")
    return result


@torch.inference_mode()
def generate(ex: Extractor, input_ids: np.ndarray, gen: Generation, limit: int) -> Generated:
    """Generate after `input_ids` (see the module's docstring). Raises SampleError `too_long` when the prompt
    leaves no position to generate in, `nonfinite` for NaN/Inf states."""
    room, steps, rng, logits, kept = start(ex, input_ids, gen, limit)
    stops = set(gen.stop_ids)
    dev = ex.device
    parts = [kept]
    out: list[int] = []
    reason = "length"
    while True:
        token = pick(logits, gen, rng)
        out.append(token)
        if token in stops:
            reason = "stop"
            break
        if len(out) >= room:
            break
        logits, kept = steps.step(torch.tensor([[token]], device=dev), keep=gen.capture)
        parts.append(kept)
    if gen.capture:
        _, kept = steps.step(torch.tensor([[out[-1]]], device=dev), logits=False)  # the last token's states
        parts.append(kept)
    return finish(out, reason, parts if gen.capture else None)
