"""A toy trainer format, whole in this one file: what a new format takes (tests/formats/test_registry.py registers
it through `builder.formats.register` and exports and imports a real build with it; nothing else in hsbuild
names it).

Its files: `samples/{i:05d}.safetensors` for export row i, holding `tokens` and `mask` (int64 [n]), `aux`
[n, k*H] and `final` [n, H], the final state before the norm; `index.json` lists the rows (sample id, tokens).
Its "trainer" numbers layers as Hugging Face's hidden_states and needs no flag for them. Like every format
module, it imports no torch at its top level.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.formats.base import DocRow, Exported, Loaded, Rejected, Sample, TrainerFormat

if TYPE_CHECKING:
    import torch

NAME = re.compile(r"(\d{5})\.safetensors$")


class ToyFormat(TrainerFormat):
    name = "toy"
    summary = "samples/NNNNN.safetensors + index.json (the registry's toy)"
    final_state = "pre_norm"
    dump_final_state = "pre_norm"
    layer_convention = "hf_hidden_states"
    doc = DocRow(trainer="none (a test's toy)", files="`samples/{i:05d}.safetensors`, `index.json`",
                 tensors="`tokens`, `mask` int64 [n], `aux` [n, kH], `final` [n, H]",
                 numbering="HF `hidden_states` index", final_state="before the norm",
                 yields="`tokens`, `states` [n, (k+1)H]", vocab="none")

    def item(self, s: Sample) -> dict[str, torch.Tensor]:
        import torch  # noqa: PLC0415

        return {"tokens": s.input_ids, "states": torch.cat([s.aux, s.final], dim=1)}

    def sample_path(self, index: int, sample_id: str) -> str:  # noqa: ARG002
        return f"samples/{index:05d}.safetensors"

    def sample_bytes(self, s: Sample) -> bytes:
        from safetensors.torch import save  # noqa: PLC0415

        return save({"tokens": s.input_ids.contiguous(), "mask": s.loss_mask.contiguous(),
                     "aux": s.aux.contiguous(), "final": s.final.contiguous()})

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,  # noqa: ARG002
                     draft_vocab_size: int | None) -> dict[str, bytes]:
        index = [{"sample_id": r.sample_id, "tokens": len(r.input_ids)} for r in rows]
        return {"index.json": json.dumps(index).encode()}

    def scan(self, root: Path) -> list[Path]:
        base = root / "samples"
        return sorted(p for p in base.iterdir() if NAME.search(p.name)) if base.is_dir() else []

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file  # noqa: PLC0415

        try:
            got = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - a file that does not read is that file's problem
            raise Rejected("unreadable", f"safetensors cannot read it ({type(e).__name__})") from None
        missing = {"tokens", "mask", "aux", "final"} - set(got)
        if missing:
            raise Rejected("bad_keys", f"has no {', '.join(sorted(missing))}")
        return got

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        got = self._read(path)
        return got["tokens"], got["mask"]

    def load(self, path: Path) -> Loaded:
        got = self._read(path)
        return Loaded(got["tokens"], got["mask"], got["aux"], got["final"], self.final_state)
