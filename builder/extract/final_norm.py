"""The model's final norm, kept in the build so that either final-state convention can be derived.

Engines return the last decoder layer's output BEFORE the final norm (an engine's layer id L); Hugging Face's
`hidden_states[L]` and SpecForge's `hidden_state` are AFTER it. A build records which one it stores
(`final_state`: pre_norm | post_norm) and keeps the norm's weight and epsilon in `final_norm.safetensors`, so
post-norm is one call away from pre-norm (`FinalNorm.apply`), computed exactly as transformers' LlamaRMSNorm
computes it (float32 statistics, then the weight in the model dtype): bit-exact to the model's own output. The
reverse is impossible, so a new build stores pre_norm by default (builder/run/create.py, choose_final_state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import ModelError
from builder.extract.safetensors_raw import DTYPE_CODES, RawTensor, read_header, read_raw, write_raw
from builder.fsutil import atomic_write_bytes

if TYPE_CHECKING:  # (torch: imported where a tensor is made; `init` copies the norm's bytes without it)
    import torch

FINAL_STATES = ("post_norm", "pre_norm")
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
             "transformer.norm.weight", "norm.weight")


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


def _norm_candidates(model_dir: Path) -> tuple[float, list[tuple[str, Path]]]:
    """(epsilon, [(tensor name, safetensors file)] that may hold the final norm's weight), from the config and
    the index; ModelError when the config has no RMSNorm epsilon."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    eps = text.get("rms_norm_eps", text.get("layer_norm_epsilon"))
    if eps is None:
        raise ModelError(f"{model_dir}/config.json: no rms_norm_eps; hsbuild derives post-norm states for RMSNorm "
                         "models only: use --final-state pre_norm")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return float(eps), [(k, model_dir / weight_map[k]) for k in NORM_KEYS if k in weight_map]
    return float(eps), [(k, p) for p in sorted(model_dir.glob("*.safetensors")) for k in NORM_KEYS]


# the decoder layers whose last output a pre_norm build stores: the module paths Extractor._last_layer hooks,
# as their weights are named in the checkpoint
LAYER_PREFIXES = ("layers.", "model.layers.", "model.language_model.layers.", "language_model.model.layers.")


def has_decoder_layers(model_dir: Path) -> bool:
    """Whether a Hugging Face directory's weights are named as the decoder layers a pre_norm build hooks (read
    from model.safetensors.index.json or the safetensors headers, no tensor); False when that cannot be told."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text()).get("weight_map", {}))
        else:
            names = [k for p in sorted(model_dir.glob("*.safetensors")) for k in read_header(p)[0]]
    except (OSError, ValueError, AttributeError):
        return False
    return any(n.startswith(LAYER_PREFIXES) for n in names)


def _no_norm(model_dir: Path) -> ModelError:
    return ModelError(f"--model '{model_dir}': no final norm weight ({', '.join(NORM_KEYS)}) in its safetensors "
                      "files; use --final-state pre_norm")


def read_final_norm(model_dir: Path, dtype: torch.dtype) -> FinalNorm:
    """The final RMSNorm of a local Hugging Face directory: only its one tensor is read (the shard that holds it,
    via model.safetensors.index.json), never the whole checkpoint."""
    try:
        from safetensors import safe_open  # noqa: PLC0415
    except ImportError:
        raise ModelError(f"--model '{model_dir}': reading its final norm needs `pip install hsbuild[hf]`") from None
    eps, candidates = _norm_candidates(model_dir)
    for key, path in candidates:
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():
                return FinalNorm(f.get_tensor(key).to(dtype), eps)
    raise _no_norm(model_dir)


@dataclass(frozen=True)
class RawFinalNorm:
    """A final norm as its checkpoint stores it, in the build's dtype: `save` writes what `FinalNorm.save` would,
    without torch (`init` reads no other tensor, and importing torch would cost it a second)."""

    weight: RawTensor
    eps: float

    def save(self, path: Path) -> None:
        write_raw(path, {"weight": self.weight}, {"eps": repr(self.eps)})


def read_final_norm_raw(model_dir: Path, dtype_name: str) -> RawFinalNorm | None:
    """The final norm of a local Hugging Face directory, its bytes as they are; None when the checkpoint stores
    it in another dtype than `dtype_name` (converting it takes torch: `read_final_norm`)."""
    eps, candidates = _norm_candidates(model_dir)
    for key, path in candidates:
        try:
            raw = read_raw(path, key)
        except (OSError, ValueError) as e:
            raise ModelError(f"--model '{model_dir}': {path.name} is unreadable ({e})") from None
        if raw is None:
            continue
        if raw.dtype != DTYPE_CODES.get(dtype_name) or len(raw.shape) != 1:
            return None
        return RawFinalNorm(raw, eps)
    raise _no_norm(model_dir)
