"""What a trainer format needs to know about a build: its geometry, its layer numbering in every convention, and
which final state it stores (with the final norm that derives the other one).

Read from `data/zarr.json` (the data describes itself, `init` writes the whole metadata there), so it needs
neither the event log nor its lock: it works during a run and on a build whose log is being rebuilt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.errors import BuildNotFoundError, FormatError
from builder.extract.final_norm import FinalNorm
from builder.layout import BuildLayout


@dataclass(frozen=True)
class BuildInfo:
    root: Path
    model: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    aux_layers: tuple[int, ...]  # Hugging Face output_hidden_states indices (0 = embeddings)
    final_state: str  # what `hidden_state` holds: "post_norm" (HF hidden_states[L]) or "pre_norm"
    dtype: str
    max_tokens: int | None
    norm: FinalNorm | None  # the model's final RMSNorm, when the build keeps it

    @classmethod
    def load(cls, lay: BuildLayout) -> BuildInfo:
        path = lay.data / "zarr.json"
        try:
            meta = json.loads(path.read_text())["attributes"]["hsbuild_meta"]
        except FileNotFoundError:
            raise BuildNotFoundError(f"{path}: missing; not an hsbuild build, or its data directory is gone") from None
        except (KeyError, ValueError) as e:
            raise BuildNotFoundError(f"{path}: unreadable build metadata ({type(e).__name__}: {e})") from None
        norm = FinalNorm.load(lay.final_norm) if lay.final_norm.is_file() else None
        fmt = meta.get("format") or {}
        return cls(root=lay.root, model=str(meta.get("model")), hidden_size=int(meta["hidden_size"]),
                   num_layers=int(meta["num_layers"]), vocab_size=int(meta.get("vocab_size") or 0),
                   aux_layers=tuple(int(i) for i in meta["aux_layers"]),
                   final_state=str(meta.get("final_state") or "post_norm"), dtype=str(meta.get("dtype", "bfloat16")),
                   max_tokens=fmt.get("max_tokens"), norm=norm)

    @property
    def n_aux(self) -> int:
        return len(self.aux_layers)

    def layer_ids(self) -> dict[str, list[int]]:
        """The aux layers (then the final state) in each numbering trainers and engines use."""
        L = self.num_layers
        return {
            # Hugging Face output_hidden_states index: 0 is the embeddings, k the output of decoder layer k-1
            "hf_hidden_states": [*self.aux_layers, L],
            # SpecForge / Model-Optimizer / EAGLE-3 configs ("eagle_aux_hidden_state_layer_ids"): decoder layer index
            "decoder_layer_output": [i - 1 for i in self.aux_layers] + [L - 1],
            # vLLM's extract_hidden_states layer ids: k = hidden_states[k] (L is the final state before the norm)
            "vllm_eagle_aux_hidden_state_layer_ids": [*self.aux_layers, L],
        }

    def require(self, want: str) -> None:
        """Raise FormatError unless the final state can be given in convention `want` (post_norm | pre_norm)."""
        if want == self.final_state:
            return
        if want == "post_norm":
            if self.norm is None:
                raise FormatError(f"{self.root}: stores the final state before the norm and keeps no final norm "
                                  f"({self.root / 'final_norm.safetensors'} is missing), so the post-norm state a "
                                  "trainer reads cannot be derived")
            return
        raise FormatError(f"{self.root}: stores the final state after the norm (final_state = post_norm), which "
                          "cannot be undone; a trainer that reads the pre-norm state needs a build made with "
                          "`hsbuild init ... --final-state pre_norm` (post-norm is derived from it bit-exactly)")

    def final(self, stored: torch.Tensor, want: str) -> torch.Tensor:
        """The stored final state [..., H] in the convention `want` (post_norm | pre_norm), bit-exact."""
        self.require(want)
        if want == self.final_state:
            return stored
        return self.norm.apply(stored)  # type: ignore[union-attr] - require() checked it is there
