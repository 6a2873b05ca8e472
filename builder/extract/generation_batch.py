"""Batched generation in-process (a regenerating build run with --batch-tokens): several requests decoded together,
each decode step one forward pass over one new token of every request, so that the model's weights, which a
one-token step spends its time reading, are read once for all of them. Each request gets exactly the tokens and
states its lone generation (builder/extract/generation.py) gives it, bit for bit:

- each prompt is prefilled alone, as a lone generation prefills it (its own cache, its own first token);
- in a decode step, what runs over all requests' rows at once is what computes each row on its own, bit for bit:
  the embedding lookup, the residual adds and products (correctly rounded elementwise operations); each row's
  rotary tables are computed alone, and each request's attention runs on its own cache, exactly as its lone step
  runs it (the model's own attention function, mask and cache update, on a copy of the row of its own);
- the matrix products (the projections, the MLP, the head) and the RMSNorms run over all rows at once only where
  this machine's kernels give each row the bits it gets alone (`RowExact`: probed once per kind, width and row
  count, through the model's own modules), else row by row (exact, and no faster than alone). A CPU kernel may
  choose its blocking from the number of rows: float32 on CPUs multiplies one row with another kernel than
  several, bfloat16 with AMX changes kernels above 32 rows. In bfloat16 on CPUs with AMX every probe up to 32
  rows passes; in float32 no product's does, so float32 gains nothing from batching;
- the activation (SiLU) runs row by row: a vectorized function may compute a row's last elements in a scalar
  loop alone and in the vector loop among other rows, which differ in the last bit on some values only (float32
  SiLU over 172 or 688 columns), too rarely for a probe to be sure of it.

Sampling draws from each request's own generator, as alone. A Hugging Face Llama (the layers `Extractor._hf_llama`
accepts, SDPA attention) is decoded in batches; any other model generates its requests one after another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from builder.errors import SampleError
from builder.extract.backends.base import Generation
from builder.extract.generation import Generated, _HfSteps, _keep, finish, pick, start

if TYPE_CHECKING:
    from builder.extract.model import Extractor

PROBE_ROWS = 32  # the rows of a product's probe: more rows than this are multiplied row by row
NORM_ROWS = 1024  # the rows of a norm's probe


class RowExact:
    """`rows(kind, fn, h)` over h [M, 1, K]: one call of `fn` on all M rows where it gives every row the bits a call
    on that row alone gives, else one call per row (each row a tensor of its own, as a lone step makes it).
    Probed once per kind, K, dtype, device, threads and M, through `fn` itself, on fixed random rows: `pool` rows
    cut in chunks of M (a matrix product differs in most outputs where its blocking does, one chunk shows it; a
    norm's reduction gives one value a row, so it is tried on many). `kind` names what decides the kernel: a
    linear layer's output width, a norm's class. A matrix product may choose its blocking from M (float32 on CPUs:
    one row runs another kernel than several; bfloat16 with AMX: another above 32 rows)."""

    def __init__(self) -> None:
        self._ok: dict[tuple, bool] = {}
        self._probe: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (kind, K, ...) -> (input, rows alone)

    def rows(self, kind: tuple, fn, h: torch.Tensor, pool: int = PROBE_ROWS) -> torch.Tensor:  # noqa: ANN001
        m = int(h.shape[0])
        if m == 1:
            return fn(h)
        shape = (*kind, int(h.shape[-1]), h.dtype, str(h.device), torch.get_num_threads(), pool)
        key = (*shape, m)
        ok = self._ok.get(key)
        if ok is None:
            ok = self._ok[key] = m <= PROBE_ROWS and self._same(fn, shape, h, m, pool)
        return fn(h) if ok else each_row(fn, h)

    def linear(self, module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return self.rows(("linear", int(module.weight.shape[0]), module.bias is None), module, h)

    def _same(self, fn, shape: tuple, h: torch.Tensor, m: int, pool: int) -> bool:  # noqa: ANN001
        if shape not in self._probe:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(pool, 1, h.shape[-1], generator=g).to(h.dtype).to(h.device)
            self._probe[shape] = (x, each_row(fn, x))
        x, alone = self._probe[shape]
        chunks = 1 if pool == PROBE_ROWS else pool // m
        return all(torch.equal(fn(x[c * m:(c + 1) * m].contiguous()), alone[c * m:(c + 1) * m])
                   for c in range(chunks))


def each_row(fn, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """`fn` on each row of h [M, ...] alone, a tensor of its own (as a lone step makes it), concatenated."""
    return torch.cat([fn(h[i:i + 1].clone()) for i in range(int(h.shape[0]))])


def _llama_parts():  # noqa: ANN202
    """transformers' own pieces of a Llama step (its mask, attention functions and rotary application), or None
    where this transformers has other names (then nothing is batched)."""
    try:
        from transformers.masking_utils import create_causal_mask  # noqa: PLC0415
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: PLC0415
    except ImportError:
        return None
    return create_causal_mask, ALL_ATTENTION_FUNCTIONS["sdpa"], apply_rotary_pos_emb


def can_batch(ex: Extractor) -> bool:
    """Whether `generate_batch` decodes this model's requests together (else one after another)."""
    return ex._hf and ex._model is not None and ex._hf_llama() is not None and _llama_parts() is not None \
        and getattr(ex._model, "lm_head", None) is not None


class _HfBatchStep:
    """One decode step of a Hugging Face Llama over one new token of each row, each row with its own cache (the
    `DynamicCache` its prefill made), as the model's forward pass runs a lone one-token step (see the module's
    docstring for what runs over all rows at once)."""

    def __init__(self, ex: Extractor):
        self.ex, self.inner, self.head = ex, ex._hf_llama(), ex._model.lm_head
        self.mask, self.attend, self.rope = _llama_parts()
        self.exact = RowExact()

    def __call__(self, tokens: list[int], caches: list, logits: list[bool], keep: list[bool]):  # noqa: ANN204
        inner, lin, rows_of, n = self.inner, self.exact.linear, self.exact.rows, len(tokens)
        dev = self.ex.device
        x = inner.embed_tokens(torch.tensor(tokens, device=dev).unsqueeze(1))  # [n, 1, H]
        pos = torch.tensor([[c.get_seq_length()] for c in caches], device=dev)
        masks = [self.mask(config=inner.config, inputs_embeds=x[i:i + 1], attention_mask=None,
                           past_key_values=caches[i], position_ids=pos[i:i + 1]) for i in range(n)]
        # each row's rotary tables alone (cos and sin are transcendental: see RowExact), [n, 1, head_dim]
        tables = [inner.rotary_emb(x[i:i + 1], position_ids=pos[i:i + 1]) for i in range(n)]
        cos, sin = torch.cat([c for c, _ in tables]), torch.cat([t for _, t in tables])
        states = [x]
        for layer in inner.layers[: inner.config.num_hidden_layers]:
            a = layer.self_attn
            h = rows_of(("norm", type(layer.input_layernorm).__name__), layer.input_layernorm, x, NORM_ROWS)
            q = lin(a.q_proj, h).view(n, 1, -1, a.head_dim).transpose(1, 2)
            k = lin(a.k_proj, h).view(n, 1, -1, a.head_dim).transpose(1, 2)
            v = lin(a.v_proj, h).view(n, 1, -1, a.head_dim).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            rows = []
            for i, cache in enumerate(caches):
                ki, vi = cache.update(k[i:i + 1].clone(), v[i:i + 1].clone(), a.layer_idx)
                out, _ = self.attend(a, q[i:i + 1].clone(), ki, vi, masks[i], dropout=0.0, scaling=a.scaling)
                rows.append(out.reshape(1, 1, -1).contiguous())
            x = x + lin(a.o_proj, torch.cat(rows))
            post = layer.post_attention_layernorm
            h = rows_of(("norm", type(post).__name__), post, x, NORM_ROWS)
            mlp = layer.mlp
            act = each_row(mlp.act_fn, lin(mlp.gate_proj, h))  # (see the module's docstring)
            x = x + lin(mlp.down_proj, act * lin(mlp.up_proj, h))
            states.append(x)
        pre = x
        states[-1] = rows_of(("norm", type(inner.norm).__name__), inner.norm, x, NORM_ROWS)
        want = [i for i in range(n) if logits[i]]
        out: list[torch.Tensor | None] = [None] * n
        if want:
            rows_logits = lin(self.head, states[-1][want] if len(want) < n else states[-1])
            for j, i in enumerate(want):
                out[i] = rows_logits[j, -1].float()
        kept = [_keep(self.ex, [s[i:i + 1] for s in states], pre[i:i + 1]) if keep[i] else None for i in range(n)]
        return out, kept


@dataclass
class _Row:
    index: int
    gen: Generation
    room: int
    steps: _HfSteps
    rng: torch.Generator
    parts: list = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    finish: str = "length"
    last: bool = False  # generated: one more step only for the last token's states (capture)

    def advance(self, logits: torch.Tensor) -> bool:
        """The next token from `logits`; True while the row needs another step."""
        token = pick(logits, self.gen, self.rng)
        self.out.append(token)
        if token in self.gen.stop_ids:
            self.finish = "stop"
        elif len(self.out) < self.room:
            return True
        self.last = self.gen.capture
        return self.last


@torch.inference_mode()
def generate_batch(ex: Extractor, requests: list[tuple[np.ndarray, Generation]],
                   limit: int) -> list[Generated | Exception]:
    """Each request's `Generated` (what `generate` returns for it alone, bit for bit), or the exception its own
    generation raises (SampleError `too_long`, `nonfinite`). A model `can_batch` refuses generates them one after
    another."""
    from builder.extract.generation import generate  # noqa: PLC0415

    results: list[Generated | Exception | None] = [None] * len(requests)
    if len(requests) == 1 or not can_batch(ex):
        for i, (ids, gen) in enumerate(requests):
            try:
                results[i] = generate(ex, ids, gen, limit)
            except Exception as e:  # noqa: BLE001 - this request's alone
                results[i] = e
        return results  # type: ignore[return-value]
    rows: list[_Row] = []
    for i, (ids, gen) in enumerate(requests):
        try:
            room, steps, rng, logits, kept = start(ex, ids, gen, limit)
        except Exception as e:  # noqa: BLE001 - this request's alone
            results[i] = e
            continue
        row = _Row(i, gen, room, steps, rng, parts=[kept])
        if row.advance(logits):
            rows.append(row)
        else:
            results[i] = _done(row)
    step = _HfBatchStep(ex)
    while rows:
        logits, kept = step([r.out[-1] for r in rows], [r.steps.cache for r in rows],
                            [not r.last for r in rows], [r.gen.capture for r in rows])
        going = []
        for r, lg, kp in zip(rows, logits, kept, strict=True):
            r.parts.append(kp)
            if not r.last and r.advance(lg):
                going.append(r)
            else:
                results[r.index] = _done(r)
        rows = going
    return results  # type: ignore[return-value]


def _done(row: _Row) -> Generated | SampleError:
    try:
        return finish(row.out, row.finish, row.parts if row.gen.capture else None)
    except SampleError as e:
        return e
