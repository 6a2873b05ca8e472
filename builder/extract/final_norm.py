"""The model's final norm, read from its checkpoint at `init` to be kept in the build (`final_norm.safetensors`),
so that either final-state convention can be derived (builder/formats/final_state.py: `FinalNorm`, what the norm
is and does once kept). Only the norm's one tensor is read, never the whole checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import ModelError
from builder.extract.safetensors_raw import DTYPE_CODES, RawTensor, read_header, read_raw, write_raw
from builder.formats.final_state import FinalNorm

if TYPE_CHECKING:  # (torch: imported where a tensor is made; `init` copies the norm's bytes without it)
    import torch

NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
             "transformer.norm.weight", "norm.weight")


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
