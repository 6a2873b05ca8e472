"""The final state a build stores and the one a trainer reads: before the model's final norm or after it, and the
norm itself, kept in the build so that the post-norm state is derived from the pre-norm one.

Engines return the last decoder layer's output BEFORE the final norm (vLLM's layer id L); Hugging Face's
`hidden_states[L]` and SpecForge's `hidden_state` are AFTER it. A build records which one it stores
(`final_state`: pre_norm | post_norm) and keeps the norm's weight and epsilon in `final_norm.safetensors`, so
post-norm is one call away from pre-norm (`FinalNorm.apply`), computed exactly as transformers' LlamaRMSNorm
computes it (float32 statistics, then the weight in the model dtype): bit-exact to the model's own output. The
reverse is impossible, so a new build stores pre_norm by default (builder/run/create.py, choose_final_state).
Reading the norm out of a model's checkpoint is the model's business (builder/extract/final_norm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.fsutil import atomic_write_bytes

if TYPE_CHECKING:  # (torch: imported where a tensor is made; `init` copies the norm's bytes without it)
    import torch

FINAL_STATES = ("post_norm", "pre_norm")


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor  # [H], the model dtype
    eps: float

    def apply(self, pre: torch.Tensor) -> torch.Tensor:
        """pre-norm states [n, H] -> post-norm, as LlamaRMSNorm.forward computes them."""
        import torch  # noqa: PLC0415

        dtype = pre.dtype
        h = pre.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight.to(dtype) * h.to(dtype)

    def save(self, path: Path) -> None:
        from safetensors.torch import save  # noqa: PLC0415

        atomic_write_bytes(path, save({"weight": self.weight.contiguous()}, metadata={"eps": repr(self.eps)}))

    @classmethod
    def load(cls, path: Path) -> FinalNorm:
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(str(path), framework="pt") as f:
            return cls(f.get_tensor("weight"), float(f.metadata()["eps"]))
