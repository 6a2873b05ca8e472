"""The built-in model (`--model builtin[:hidden=256,layers=8,...]`): a small Llama-architecture model (RMSNorm, RoPE,
grouped-query attention, SwiGLU MLP) with deterministic random weights, built locally (no download); and the
per-sample pieces a packed forward pass runs (`segments`), which the Hugging Face packed pass reuses."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from builder.extract.spec import BuiltinSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Batched extraction (`Extractor.extract_batch`) must give every sample the bits its own forward pass gives it.
# A matrix product's rows do not have that property: the CPU kernels (oneDNN, MKL) choose their blocking and
# thread split, sometimes a split of the inner dimension, from the number of rows, so a sample's rows multiplied
# as part of a longer packed matrix can differ from the same rows multiplied alone (measured: 1-3% of samples
# differ in the last bit with 2 threads in bfloat16). So in a packed forward pass every product and every
# attention runs per sample, on exactly the operands `forward` gives it; what runs over all samples' tokens at
# once is what computes each row on its own: embedding lookups, the RMSNorms (a reduction within each row) and
# the residual adds (elementwise, correctly rounded).


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    return [(int(a), int(n)) for a, n in zip(starts, lengths, strict=True)]


def segments(fn, h: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """fn(i, sample i's rows of `h` [1, T, ...]) for each span, concatenated back along the tokens. Each sample's
    rows are copied to a tensor of their own: the operand the kernels see is the one a lone forward pass makes."""
    if len(spans) == 1:
        return fn(0, h)
    return torch.cat([fn(i, h[:, a:a + n].clone()) for i, (a, n) in enumerate(spans)], dim=1)


class Block(nn.Module):
    def __init__(self, s: BuiltinSpec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.input_layernorm = RMSNorm(s.hidden)
        self.q_proj = nn.Linear(s.hidden, s.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * self.head_dim, s.hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(s.hidden)
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention sublayer of one sample's normed states `h` [b, n, H] (its projections included)."""
        b, n, _ = h.shape
        q = self.q_proj(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, n, -1))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_packed(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                       spans: list[tuple[int, int]]) -> torch.Tensor:
        """Several samples packed along the tokens of `x` [1, T, H] (`spans`: each one's start and length): the
        norms and residual adds run over all tokens at once (row-wise operations), each sample's projections,
        attention and MLP run on its own tokens, exactly as `forward` runs them (see `segments`)."""
        x = x + segments(lambda i, h: self.attention(h, *ropes[i]), self.input_layernorm(x), spans)
        return x + segments(lambda _i, h: self.mlp(h), self.post_attention_layernorm(x), spans)


class BuiltinLlama(nn.Module):
    def __init__(self, s: BuiltinSpec):
        super().__init__()
        self.spec = s
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        head_dim = s.hidden // s.heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        # its language-model head (generation only: builder/extract/generation.py): random like its weights, drawn
        # after them; not in the state dict, so the model's fingerprint is what it was before it had one
        self.register_buffer("lm_head", torch.zeros(s.vocab, s.hidden), persistent=False)

    @torch.no_grad()
    def init_deterministic(self) -> None:
        g = torch.Generator().manual_seed(self.spec.seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                std = 0.02 if "embed" not in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * std)
        self.lm_head.copy_(torch.randn(self.lm_head.shape, generator=g) * 0.02)
        if 0 <= self.spec.nan_token < self.spec.vocab:
            self.embed_tokens.weight[self.spec.nan_token] = float("nan")

    def rope_tables(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0..n-1, [n, head_dim], in the dtype of `like`."""
        pos = torch.arange(n, dtype=torch.float32, device=like.device)
        freqs = torch.outer(pos, self.inv_freq.to(like.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(like.dtype), emb.sin().to(like.dtype)

    def forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_tables(input_ids.shape[1], x)
        states = [x]
        for layer in self.layers:
            x = layer(x, cos, sin)
            states.append(x)
        states[-1] = self.norm(x)
        return states

    def forward_packed(self, input_ids: torch.Tensor, lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Samples packed in `input_ids` [1, T] (their `lengths` sum to T), each at positions 0..n-1: (states as
        `forward` returns them, [1, T, H] each, the last layer's output before the final norm)."""
        x = self.embed_tokens(input_ids)
        ropes = [self.rope_tables(n, x) for n in lengths]  # each sample's own tables, computed as `forward` does
        spans = _spans(lengths)
        states = [x]
        for layer in self.layers:
            x = layer.forward_packed(x, ropes, spans)
            states.append(x)
        states[-1] = self.norm(x)
        return states, x
