"""What a trainer format needs to know about a build: its geometry, its layer numbering in every convention,
which final state it stores (with the final norm that derives the other one), which trainers it can feed and
the layer flag each needs (asked of each exporting format in the registry), and whether its states are stored
lossy (`--quantize fp8`). Export, import and the reader all use it.

Read from `data/zarr.json` (the data describes itself, `init` writes the whole metadata there), so it needs
neither the event log nor its lock: it works during a run and on a build whose log is being rebuilt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import BuildNotFoundError, FormatError
from builder.formats import registry
from builder.formats.final_state import FinalNorm
from builder.formats.numbering import layer_numberings
from builder.layout import BuildLayout

if TYPE_CHECKING:  # (torch: imported where a tensor is made; `init` describes a build without it)
    import torch


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
    norm_file: Path | None  # final_norm.safetensors: the model's final RMSNorm, when the build keeps it
    # an fp8 build (`init --quantize fp8`): how its states are stored lossy (scheme, scale blocks), else None
    lossy: dict | None = None
    final_state_why: str | None = None  # a build made without --final-state: why init chose its final state

    @classmethod
    def load(cls, lay: BuildLayout) -> BuildInfo:
        path = lay.data / "zarr.json"
        try:
            meta = json.loads(path.read_text())["attributes"]["hsbuild_meta"]
        except FileNotFoundError:
            raise BuildNotFoundError(f"{path}: missing; not an hsbuild build, or its data directory is gone") from None
        except (KeyError, ValueError) as e:
            raise BuildNotFoundError(f"{path}: unreadable build metadata ({type(e).__name__}: {e})") from None
        norm = lay.final_norm if lay.final_norm.is_file() else None
        fmt = meta.get("format") or {}
        hidden, aux = int(meta["hidden_size"]), tuple(int(i) for i in meta["aux_layers"])
        dtype = str(meta.get("dtype", "bfloat16"))
        return cls(root=lay.root, model=str(meta.get("model")), hidden_size=hidden,
                   num_layers=int(meta["num_layers"]), vocab_size=int(meta.get("vocab_size") or 0), aux_layers=aux,
                   # a build made before `final_state` was recorded stores the post-norm state
                   final_state=str(meta.get("final_state") or "post_norm"), dtype=dtype,
                   max_tokens=fmt.get("max_tokens"), norm_file=norm, lossy=_lossy(meta, hidden, len(aux), dtype),
                   final_state_why=(meta.get("final_state_choice") or {}).get("why"))

    @cached_property
    def norm(self) -> FinalNorm | None:
        """The kept final norm (loaded at first use: it takes torch)."""
        return FinalNorm.load(self.norm_file) if self.norm_file is not None else None

    @property
    def n_aux(self) -> int:
        return len(self.aux_layers)

    def layer_ids(self) -> dict[str, list[int]]:
        """The aux layers (then the final state) in each numbering trainers and engines use."""
        return layer_numberings(self.aux_layers, self.num_layers)

    def derives(self, want: str) -> bool:
        """Whether the final state can be given in convention `want`: the stored one, or post-norm derived from
        a pre-norm state with the kept norm (never the other way: the norm cannot be undone)."""
        return want == self.final_state or (want == "post_norm" and self.norm_file is not None)

    def trainers(self) -> dict[str, str | None]:
        """Each trainer hsbuild exports to (the formats that hold hidden states): None when this build can feed
        it, else why not and what fixes it."""
        out: dict[str, str | None] = {}
        for fmt in registry.formats(exports=True, states=True):
            name, want = fmt.name, fmt.final_state
            if self.derives(want):
                out[name] = None
            elif want == "pre_norm":
                out[name] = ("it reads the final state before the norm, which a post_norm build cannot give: "
                             "a build made with `hsbuild init ... --final-state pre_norm` feeds it")
            else:
                out[name] = ("it reads the final state after the norm, which this pre_norm build cannot derive "
                             "without the model's final norm (final_norm.safetensors is missing)")
        return out

    def layer_flag(self, trainer: str) -> str | None:
        """What `trainer` must be told so that it takes this build's aux layers (its flag or config key, in its own
        numbering), or None when its default is exactly them."""
        fmt = registry.get(trainer)
        ids = self.layer_ids()[fmt.layer_convention][:-1]
        if fmt.default_layers(self.num_layers) in (None, ids):
            return None
        return fmt.layer_flag(ids)

    def feeds(self) -> list[str]:
        """What `init` says about a new build: the final state it stores, the trainers it can feed (naming the one
        it cannot and the flag that fixes that), and each trainer's layer flag where its default differs."""
        lines = [f"final state: {self.final_state}" + (f" ({self.final_state_why})" if self.final_state_why else "")]
        trainers = self.trainers()
        ok = [t for t, why in trainers.items() if why is None]
        lines.append("trainers: " + (", ".join(ok) if ok else "none"))
        lines += [f"  not {t}: {why}" for t, why in trainers.items() if why is not None]
        flags = {t: self.layer_flag(t) for t in ok}
        if any(flags.values()):
            lines.append(f"aux layers (hidden_states) {list(self.aux_layers)} are not every trainer's default "
                         f"for a {self.num_layers}-layer model; tell each:")
            lines += [f"  {t}: {f}" for t, f in flags.items() if f]
        return lines

    def require(self, want: str) -> None:
        """Raise FormatError unless the final state can be given in convention `want` (post_norm | pre_norm)."""
        if want == self.final_state:
            return
        if want == "post_norm":
            if self.norm_file is None:
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


def _lossy(meta: dict, hidden: int, n_aux: int, dtype: str) -> dict | None:
    """An fp8 build's storage scheme as `init` recorded it (meta `quantize`), with the size of the blocks that
    share one scale; None for a build that stores its states exactly."""
    q = meta.get("quantize")
    if not isinstance(q, dict) or not q.get("lossy"):
        return None
    return {"scheme": str(q.get("scheme")), "lossy": True, "read_as": str(q.get("read_as") or dtype),
            "stored": str(q.get("stored") or ""),
            # quantize_fp8 (store/codec.py): one float32 scale per token of each state field, over all its values
            "scale_block": {"hidden_state": hidden, "aux_hidden_state": n_aux * hidden},
            "scale_block_unit": "values of one token of the field (one float32 scale, max |x| / 448, each)"}
