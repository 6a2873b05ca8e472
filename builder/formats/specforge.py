"""SpecForge (sgl-project/SpecForge 0.2.0): offline EAGLE-3 features, one `torch.save` dict a sample.

Checked against its code (scripts/prepare_hidden_states.py, specforge/data/preprocessing.py,
specforge/algorithms/eagle3/data.py, specforge/training/vocab_mapping.py):

- layout `rows_{g}-{g+2000}/data_{i}.ckpt` (g = i // 2000 * 2000), or `.ckpt.gz`: a gzip stream of the same
  `torch.save` bytes (`--compress`); readers walk the tree for both suffixes and sort the paths as strings;
- a file holds `input_ids` int64 [n], `loss_mask` int64 [n], `aux_hidden_state` [1, n, 3H] (the aux layers
  concatenated in layer order) and `hidden_state` [1, n, H]: the final state AFTER the norm (the lm_head input);
- aux layer ids count decoder layers (id k = the output of decoder layer k = Hugging Face hidden_states[k+1]);
- its own producer right-pads each file with (token 0, mask 0) to its batch's longest row: an import strips
  such a tail when the source row is shorter;
- its dataset (`normalize_offline_sample`) yields input_ids/loss_mask [1, n'] (the mask's last position zeroed),
  attention_mask ones, `hidden_state` = the aux states, `target` = the final state, n' = min(n, max_len);
- a reduced draft vocabulary: `{"d2t": int64 [D] offsets (target = draft + d2t[draft]), "t2d": bool [V]}`
  from the D most frequent loss-masked tokens, sorted by id (`vocab_mapping/vocab_mapping.pt`, passed to
  training as `model.vocab_mapping_path`), ties broken as SpecForge breaks them when it derives the mapping
  from the same files itself (formats/vocab.py: the token it counts first, walking the files in path order).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.formats.base import (
    DocRow,
    Exported,
    Loaded,
    Rejected,
    Sample,
    Streamed,
    TrainerFormat,
    files_under,
)

if TYPE_CHECKING:
    import torch

GROUP = 2000
NAME = re.compile(r"data_(\d+)\.ckpt(\.gz)?$")


class SpecForge(TrainerFormat):
    name = "specforge"
    summary = "rows_*/data_N.ckpt (SpecForge's prepare_hidden_states)"
    final_state = "post_norm"
    dump_final_state = "post_norm"
    layer_convention = "decoder_layer_output"
    options = {"max_len": "keep this many tokens of a sample, as its dataset's data.max_length",
               "compress": "gzip each file at this level (its --compress; .ckpt.gz)"}
    doc = DocRow(
        trainer="SpecForge 0.2.0 (`scripts/prepare_hidden_states.py`; `OfflineEagle3Dataset`, "
                "`normalize_offline_sample`)",
        files="`rows_{g}-{g+2000}/data_{i}.ckpt` (`.ckpt.gz` with `--compress`), one `torch.save` dict",
        tensors="`input_ids` int64 [n], `loss_mask` int64 [n], `aux_hidden_state` [1, n, 3H], `hidden_state` "
                "[1, n, H]",
        numbering="decoder layer: id k = output of layer k = HF `hidden_states[k+1]` (default `1, L//2-1, L-4`)",
        final_state="after the norm (the lm_head input)",
        yields="`input_ids`, `loss_mask` (last position 0), `attention_mask` [1, n'], `hidden_state` (the aux "
               "states), `target` (the final state); n' = min(n, max_len)",
        vocab="`token_freq.pt`; `vocab_mapping/vocab_mapping.pt` = `{\"d2t\", \"t2d\"}` (`model.vocab_mapping_path`)")

    max_len: int | None = None  # what the trainer's data.max_length keeps (None: the whole sample)
    compress: int | None = None  # gzip level for export (SpecForge's --compress), None: plain .ckpt

    @classmethod
    def default_layers(cls, num_layers: int) -> list[int]:
        # algorithms/model_providers.py resolve_eagle_capture_layers: decoder ids 1, L//2-1, L-4
        return [1, num_layers // 2 - 1, num_layers - 4]

    @classmethod
    def layer_flag(cls, ids: list[int]) -> str:
        return f"model.aux_hidden_state_layer_ids=[{','.join(map(str, ids))}] (a `specforge train` override)"

    def item(self, s: Sample) -> dict[str, torch.Tensor]:
        import torch  # noqa: PLC0415

        n = s.num_tokens if self.max_len is None else min(s.num_tokens, self.max_len)
        loss_mask = s.loss_mask[:n].clone().unsqueeze(0)
        if loss_mask.numel() > 0:
            loss_mask[0, -1] = 0
        return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask,
                "target": s.final[:n].unsqueeze(0), "hidden_state": s.aux[:n].unsqueeze(0),
                "input_ids": s.input_ids[:n].unsqueeze(0)}

    @staticmethod
    def path_for(index: int, gz: bool = False) -> str:
        g = index // GROUP * GROUP
        return f"rows_{g}-{g + GROUP}/data_{index}.ckpt" + (".gz" if gz else "")

    def sample_path(self, index: int, sample_id: str) -> str:  # noqa: ARG002
        return self.path_for(index, gz=self.compress is not None)

    def sample_bytes(self, s: Sample) -> bytes | Streamed:
        import gzip  # noqa: PLC0415

        from builder.formats.torchfile import save_bytes, save_streamed  # noqa: PLC0415

        rec = {"input_ids": s.input_ids, "loss_mask": s.loss_mask,
               "aux_hidden_state": s.aux.unsqueeze(0), "hidden_state": s.final.unsqueeze(0)}
        if self.compress is None:
            return save_streamed(rec)
        return gzip.compress(save_bytes(rec), compresslevel=self.compress, mtime=0)

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,
                     draft_vocab_size: int | None) -> dict[str, bytes]:
        from builder.formats.torchfile import save_bytes  # noqa: PLC0415
        from builder.formats.vocab import specforge_counts, specforge_vocab_mapping  # noqa: PLC0415

        files = {"token_freq.pt": save_bytes(dict(sorted(freq.items())))}
        if not draft_vocab_size:
            for _ in rows:  # nothing per row: the feature files are the dataset
                pass
            return files
        # counted as SpecForge counts the files itself (its ties go to the token it counted first)
        gz = self.compress is not None
        counts = specforge_counts(((r.index, r.input_ids, r.loss_mask) for r in rows),
                                  lambda i: self.path_for(i, gz=gz), vocab_size, self.max_len)
        d2t, t2d = specforge_vocab_mapping(counts, draft_vocab_size, vocab_size)
        files["vocab_mapping/vocab_mapping.pt"] = save_bytes({"d2t": d2t, "t2d": t2d})
        return files

    def scan(self, root: Path) -> list[Path]:
        return files_under(root, lambda name: NAME.search(name) is not None)

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        from builder.formats.torchfile import int_1d, load_file  # noqa: PLC0415

        d = load_file(path)
        return int_1d(d, ("input_ids",)), int_1d(d, ("loss_mask",))

    def load(self, path: Path) -> Loaded:
        import torch  # noqa: PLC0415

        from builder.formats.torchfile import int_1d, load_file  # noqa: PLC0415

        d = load_file(path)
        ids = int_1d(d, ("input_ids",))
        mask = int_1d(d, ("loss_mask",))
        n = ids.shape[0]
        aux, final = d.get("aux_hidden_state"), d.get("hidden_state")
        for key, t in (("aux_hidden_state", aux), ("hidden_state", final)):
            if not isinstance(t, torch.Tensor):
                raise Rejected("bad_keys", f"has no tensor '{key}' (keys: {sorted(d)})")
            if t.dim() != 3 or t.shape[0] != 1 or t.shape[1] != n:
                raise Rejected("bad_shape", f"'{key}' has shape {list(t.shape)}, expected [1, {n}, ...] "
                                            f"for its {n} input_ids")
        return Loaded(ids, mask, aux[0], final[0], self.final_state)
