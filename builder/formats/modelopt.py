"""NVIDIA Model-Optimizer (nvidia-modelopt 0.47.0): offline EAGLE-3 dumps, one `torch.save` dict a conversation.

Checked against its code (examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py,
modelopt/torch/speculative/eagle/utils.py OfflineSupervisedDataset, scripts/calibrate_draft_vocab.py):

- `OUT/{conversation_id}.pt`, flat (hsbuild: the id URL-quoted, a long one shortened: `ModelOpt.file_name`);
  the training script takes every `*.pt` under the folder (recursively) as a sample, so nothing else in the
  folder may end in `.pt`;
- a file holds `input_ids` int64 [n], `hidden_states` [n, H] (AFTER the final norm: Hugging Face
  hidden_states[-1]; `hidden_states_prenorm: True` marks a state before it, which training normalizes),
  `aux_hidden_states` [n, k*H] (decoder-layer ids: id k = hidden_states[k+1]), `loss_mask` int64 [n] and
  `conversation_id`;
- its dataset (answer_only_loss=True) yields input_ids, base_model_hidden_states, aux_hidden_states,
  attention_mask (ones), loss_mask (the file's), labels (input_ids shifted left, last -100) and
  base_hidden_prenorm;
- a reduced draft vocabulary is a bare int64 tensor d2t [D] (target id = draft id + d2t[draft id]), loaded from
  the recipe's `data.draft_vocab_cache`: written as `d2t.torch` (not `.pt`, which training would read as a
  sample).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

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

NAME_BYTES = 200  # a longer file name is shortened (file_name): NAME_MAX is 255 bytes, the export's temp name longer


class ModelOpt(TrainerFormat):
    name = "modelopt"
    summary = "ID.pt (Model-Optimizer's compute_hidden_states)"
    final_state = "post_norm"
    dump_final_state = "post_norm"
    layer_convention = "decoder_layer_output"
    doc = DocRow(
        trainer="Model-Optimizer 0.47.0 (`compute_hidden_states_hf.py`; `OfflineSupervisedDataset`)",
        files="`{conversation_id}.pt` (the sample id, URL-quoted; a name over 200 bytes: its first bytes, `+` and a "
              "blake2b-128 of the id, so every id fits a file name), one `torch.save` dict",
        tensors="`input_ids` int64 [n], `hidden_states` [n, H], `aux_hidden_states` [n, kH], `loss_mask` int64 "
                "[n], `conversation_id`",
        numbering="decoder layer (as SpecForge)",
        final_state="after the norm (`hidden_states_prenorm: True` would mark it before)",
        yields="(answer_only_loss=True) `input_ids`, `base_model_hidden_states`, `aux_hidden_states`, "
               "`attention_mask`, `loss_mask`, `labels` (shifted), `base_hidden_prenorm`",
        vocab="`token_freq.json`; `d2t.torch` = bare int64 [D] (`data.draft_vocab_cache`; not `.pt`: every `.pt` "
              "is read as a sample)")

    @classmethod
    def default_layers(cls, num_layers: int) -> list[int]:
        # plugins/hf_eagle.py default_eagle_aux_layer_ids: the SET of decoder ids 1, L//2-1, L-4 (fewer than
        # three below 7 layers)
        return sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})

    @classmethod
    def layer_flag(cls, ids: list[int]) -> str:
        return (f"eagle_architecture_config: {{eagle_aux_hidden_state_layer_ids: [{', '.join(map(str, ids))}]}} "
                "(its EAGLE config)")

    def item(self, s: Sample) -> dict[str, torch.Tensor | bool]:
        import torch  # noqa: PLC0415

        labels = torch.full_like(s.input_ids, -100)
        labels[:-1] = s.input_ids[1:]
        return {"input_ids": s.input_ids, "base_model_hidden_states": s.final, "aux_hidden_states": s.aux,
                "attention_mask": torch.ones_like(s.input_ids), "loss_mask": s.loss_mask.to(s.input_ids.dtype),
                "labels": labels, "base_hidden_prenorm": False}

    @staticmethod
    def file_name(sample_id: str) -> str:
        """`{id}.pt`, the id URL-quoted (a leading dot too: no file is hidden). An id whose name would be longer
        than NAME_BYTES keeps a readable prefix and ends in `+` and a blake2b-128 of the whole id: quoting never
        writes `+`, so such a name is no other id's, and it fits the usual 255-byte limit (NAME_MAX) with the
        export's temp suffix. The file's `conversation_id` is the whole id."""
        name = quote(sample_id, safe="-_.~")
        if name.startswith("."):
            name = "%2E" + name[1:]
        if len(name) + len(".pt") <= NAME_BYTES:
            return name + ".pt"
        h = hashlib.blake2b(sample_id.encode(), digest_size=16).hexdigest()
        cut = NAME_BYTES - len(".pt") - 1 - len(h)
        if "%" in name[cut - 2: cut]:  # never split a %XX escape
            cut = name.rindex("%", 0, cut)
        return f"{name[:cut]}+{h}.pt"

    def sample_path(self, index: int, sample_id: str) -> str:  # noqa: ARG002
        return self.file_name(sample_id)

    def sample_bytes(self, s: Sample) -> bytes | Streamed:
        from builder.formats.torchfile import save_streamed  # noqa: PLC0415

        rec = {"input_ids": s.input_ids, "hidden_states": s.final, "aux_hidden_states": s.aux,
               "loss_mask": s.loss_mask, "conversation_id": s.sample_id}
        return save_streamed(rec)

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,  # noqa: ARG002
                     draft_vocab_size: int | None) -> dict[str, bytes]:
        from builder.formats.torchfile import save_bytes  # noqa: PLC0415
        from builder.formats.vocab import vocab_mapping  # noqa: PLC0415

        files = {"token_freq.json": json.dumps({str(k): v for k, v in sorted(freq.items())}).encode()}
        if draft_vocab_size:
            d2t, _ = vocab_mapping(freq, draft_vocab_size, vocab_size)
            files["d2t.torch"] = save_bytes(d2t)
        return files

    def scan(self, root: Path) -> list[Path]:
        return files_under(root, lambda name: name.endswith(".pt"))

    def named_sample(self, path: Path) -> str:
        return unquote(path.name.split(".")[0])

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        from builder.formats.torchfile import int_1d, load_dict  # noqa: PLC0415

        d = load_dict(path)
        ids = int_1d(d, ("input_ids",), batch_axis=False)
        return ids, (int_1d(d, ("loss_mask",), batch_axis=False) if d.get("loss_mask") is not None else None)

    def load(self, path: Path) -> Loaded:
        import torch  # noqa: PLC0415

        from builder.formats.torchfile import int_1d, load_dict  # noqa: PLC0415

        d = load_dict(path)
        ids = int_1d(d, ("input_ids",), batch_axis=False)
        mask = int_1d(d, ("loss_mask",), batch_axis=False) if d.get("loss_mask") is not None else None
        n = ids.shape[0]
        final, aux = d.get("hidden_states"), d.get("aux_hidden_states")
        for key, t in (("hidden_states", final), ("aux_hidden_states", aux)):
            if not isinstance(t, torch.Tensor):
                raise Rejected("bad_keys", f"has no tensor '{key}' (keys: {sorted(d)})")
            if t.dim() != 2 or t.shape[0] != n:
                raise Rejected("bad_shape", f"'{key}' has shape {list(t.shape)}, expected [{n}, ...] for its "
                                            f"{n} input_ids")
        state = "pre_norm" if d.get("hidden_states_prenorm") else "post_norm"
        return Loaded(ids, mask, aux, final, state)
