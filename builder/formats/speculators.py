"""speculators (vllm-project/speculators 0.9.0): a Hugging Face `datasets` directory plus one safetensors file of
hidden states a row.

Checked against its code (speculators/train/data.py ArrowDataset, speculators/train/vocab_mapping.py,
speculators/train/cli.py, hs_connectors/transfer.py FileTransfer / FP8Transfer):

- `OUT/` is a `datasets.save_to_disk` directory (Arrow stream `data-00000-of-00001.arrow`, `state.json` with the
  torch format, `dataset_info.json`) with `input_ids` and `loss_mask` (int64 lists) and `seq_len` (int64);
- `OUT/hidden_states/hs_{i}.safetensors` for dataset row i holds `token_ids` int64 [n] and `hidden_states`
  [n, k+1, H]: the aux layers in ascending vLLM layer id, then the final state BEFORE the norm (vLLM's layer id L;
  the trainer applies the verifier's norm itself); an FP8 file adds `hidden_states_scales` [n, 1, 1] (lossy:
  not imported);
- its dataset yields `hidden_states` [n, k*H] (the aux slots flattened), `input_ids`, `verifier_last_hidden_states`
  [n, H], `loss_mask` (from the Arrow row), `lengths` [1] and `position_ids` [n];
- `OUT/token_freq.pt` ({token id: count} over loss-masked tokens) is where training looks for the frequencies it
  builds the draft vocabulary from; `d2t-{D}.npy`/`t2d-{D}.npy` are the names its training loads from
  the data path with `--draft-vocab-size D` (or names with `--d2t-path/--t2d-path`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.formats.base import DocRow, Exported, Loaded, Rejected, Sample, TrainerFormat

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch

NAME = re.compile(r"hs_(\d+)\.safetensors$")
ARROW = "data-00000-of-00001.arrow"
FEATURES = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "seq_len": {"dtype": "int64", "_type": "Value"}}


class Speculators(TrainerFormat):
    name = "speculators"
    summary = "a datasets dir + hidden_states/hs_N.safetensors"
    final_state = "pre_norm"
    dump_final_state = "pre_norm"
    layer_convention = "vllm_eagle_aux_hidden_state_layer_ids"
    doc = DocRow(
        trainer="speculators 0.9.0 (`ArrowDataset`, `hs_connectors.FileTransfer`)",
        files="a `datasets` directory (`input_ids`, `loss_mask`, `seq_len`) + `hidden_states/hs_{i}.safetensors`",
        tensors="`token_ids` int64 [n], `hidden_states` [n, k+1, H]",
        numbering="vLLM `extract_hidden_states` id: k = HF `hidden_states[k]`",
        final_state="before the norm (vLLM's id L; the trainer applies the verifier's norm)",
        yields="`hidden_states` [n, kH], `input_ids`, `verifier_last_hidden_states` [n, H], `loss_mask`, "
               "`lengths`, `position_ids`",
        vocab="`token_freq.pt` (read by training from the data dir); `d2t-{D}.npy`, `t2d-{D}.npy` (the names its "
              "training loads with `--draft-vocab-size D`)")

    @classmethod
    def default_layers(cls, num_layers: int) -> list[int]:
        # models/utils.py resolve_target_layer_ids: vLLM ids 2, L//2, L-3 (refused when repeated or out of range)
        return [2, num_layers // 2, num_layers - 3]

    @classmethod
    def layer_flag(cls, ids: list[int]) -> str:
        return "--target-layer-ids " + " ".join(map(str, ids))

    def item(self, s: Sample) -> dict[str, torch.Tensor]:
        import torch  # noqa: PLC0415

        n = s.num_tokens
        return {"hidden_states": s.aux, "input_ids": s.input_ids, "verifier_last_hidden_states": s.final,
                "loss_mask": s.loss_mask, "lengths": torch.tensor([n], dtype=torch.long),
                "position_ids": torch.arange(n, dtype=torch.long)}

    @staticmethod
    def stacked(s: Sample) -> torch.Tensor:
        import torch  # noqa: PLC0415

        n, h = s.final.shape
        return torch.cat([s.aux.reshape(n, -1, h), s.final.unsqueeze(1)], dim=1)  # [n, k+1, H]

    def sample_path(self, index: int, sample_id: str) -> str:  # noqa: ARG002
        return f"hidden_states/hs_{index}.safetensors"

    def sample_bytes(self, s: Sample) -> bytes:
        from safetensors.torch import save  # noqa: PLC0415

        return save({"hidden_states": self.stacked(s).contiguous(), "token_ids": s.input_ids.contiguous()})

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,  # noqa: ARG002
                     draft_vocab_size: int | None) -> dict[str, bytes | Callable[[Path], None]]:
        """The Arrow dataset (streamed to its file), then state.json last: `load_from_disk` needs both."""
        from builder.formats.torchfile import save_bytes  # noqa: PLC0415
        from builder.formats.vocab import vocab_mapping  # noqa: PLC0415

        files: dict[str, bytes | Callable[[Path], None]] = {ARROW: lambda path: write_arrow(path, rows)}
        files["dataset_info.json"] = json.dumps({"citation": "", "description": "", "features": FEATURES,
                                                 "homepage": "", "license": ""}, indent=2).encode()
        files["state.json"] = json.dumps({"_data_files": [{"filename": ARROW}], "_fingerprint": "hsbuild",
                                          "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch",
                                          "_output_all_columns": False, "_split": None}, indent=2).encode()
        files["token_freq.pt"] = save_bytes(dict(sorted(freq.items())))
        if draft_vocab_size:
            d2t, t2d = vocab_mapping(freq, draft_vocab_size, vocab_size)
            # the names its train CLI looks for in the data path with --draft-vocab-size D (cli.py
            # parse_vocab_mappings), so no --d2t-path/--t2d-path is needed
            files[f"d2t-{draft_vocab_size}.npy"] = _npy(d2t.numpy())
            files[f"t2d-{draft_vocab_size}.npy"] = _npy(t2d.numpy())
        return files

    def scan(self, root: Path) -> list[Path]:
        base = root / "hidden_states" if (root / "hidden_states").is_dir() else root
        return sorted(p for p in base.iterdir() if p.is_file() and NAME.search(p.name))

    def named_sample(self, path: Path) -> int | None:
        m = NAME.search(path.name)
        return int(m.group(1)) if m else None

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _open(path) as f:
            if "token_ids" not in f.keys():
                raise Rejected("bad_keys", f"has no tensor 'token_ids' (keys: {sorted(f.keys())})")
            return _ids(f.get_tensor("token_ids")), None

    def load(self, path: Path) -> Loaded:
        with _open(path) as f:
            keys = set(f.keys())
            if not {"token_ids", "hidden_states"} <= keys:
                raise Rejected("bad_keys", f"has {sorted(keys)}, not token_ids and hidden_states")
            try:
                ids, hs = _ids(f.get_tensor("token_ids")), f.get_tensor("hidden_states")
                scales = f.get_tensor("hidden_states_scales") if "hidden_states_scales" in keys else None
            except Exception as e:  # noqa: BLE001 - a header that parses but data cut short
                raise Rejected("truncated", f"a tensor does not read ({type(e).__name__}: {e})") from None
        if scales is not None:
            raise Rejected("bad_dtype", "holds FP8 states (hs_connectors' FP8 connector, hidden_states_scales): "
                                        "lossy, and a build holds the model's own states bit-exact; let resume "
                                        "extract this sample")
        n = ids.shape[0]
        if hs.dim() != 3 or hs.shape[0] != n or hs.shape[1] < 2:
            raise Rejected("bad_shape", f"'hidden_states' has shape {list(hs.shape)}, expected [{n}, k+1, H] for "
                                        f"its {n} token_ids")
        return Loaded(ids, None, hs[:, :-1].reshape(n, -1), hs[:, -1], self.final_state)


def _open(path: Path):
    from safetensors import safe_open  # noqa: PLC0415

    try:
        if path.stat().st_size == 0:
            raise Rejected("truncated", "is empty (0 bytes)")
        return safe_open(str(path), framework="pt")
    except Rejected:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError: a header cut short or garbled
        msg = str(e).splitlines()[0][:200]
        raise Rejected("truncated" if "incomplete" in msg.lower() or "too small" in msg.lower() else "unreadable",
                       f"safetensors cannot open it ({msg})") from None


def _ids(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 1 or t.dtype.is_floating_point:
        raise Rejected("bad_shape", f"'token_ids' is {t.dtype} {list(t.shape)}, expected integers [n]")
    return t.long()


def _npy(a: np.ndarray) -> bytes:
    import io  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def schema() -> pa.Schema:
    """The dataset's Arrow schema, with the features `datasets` reads back."""
    import pyarrow as pa  # noqa: PLC0415

    return pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                      ("seq_len", pa.int64())], metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})})


def write_arrow(path: Path, rows: Iterable[Exported], batch: int = 1024) -> None:
    """The dataset's Arrow stream, written a batch of rows at a time (a 1M-row export never holds all rows)."""
    import pyarrow as pa  # noqa: PLC0415

    sch = schema()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, sch) as w:
        buf: list[Exported] = []

        def put() -> None:
            w.write_batch(pa.record_batch([pa.array([r.input_ids for r in buf], pa.list_(pa.int64())),
                                           pa.array([r.loss_mask for r in buf], pa.list_(pa.int64())),
                                           pa.array([len(r.input_ids) for r in buf], pa.int64())], schema=sch))
            buf.clear()

        for r in rows:
            buf.append(r)
            if len(buf) >= batch:
                put()
        if buf:
            put()
