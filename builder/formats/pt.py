"""Import only: any folder of `torch.save` dicts, one sample a file (`*.pt`, `*.ckpt`, `*.pth`, also gzipped),
as home-grown extraction scripts write them (the incident's dump: `rows_*/data_*.pt`).

Keys are recognised by their usual names: the tokens in `input_ids` or `token_ids`; the aux states in
`aux_hidden_state(s)` ([n, k*H] or [1, n, k*H]) or a stacked `hidden_states` [n, k+1, H] (aux slots, then the
final state); the final state in `hidden_state` / `hidden_states` / `last_hidden_state` ([n, H] or [1, n, H]);
an optional `loss_mask`. The final state is taken as AFTER the norm (Hugging Face hidden_states[-1]) unless the
file says `hidden_states_prenorm: True`; `hsbuild import --dump-final-state pre_norm` says so for a whole dump.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from builder.formats.base import DocRow, Loaded, Rejected, TrainerFormat, files_under

if TYPE_CHECKING:
    import torch

SUFFIXES = (".pt", ".ckpt", ".pth", ".pt.gz", ".ckpt.gz", ".pth.gz")
TOKENS = ("input_ids", "token_ids")
AUX = ("aux_hidden_state", "aux_hidden_states")
FINAL = ("hidden_state", "hidden_states", "last_hidden_state", "last_hidden_states")


class PlainPt(TrainerFormat):
    name = "pt"
    summary = "any folder of torch.save dicts (*.pt, *.ckpt, *.pth)"
    exports = False
    layer_convention = "decoder_layer_output"
    options = {"final_state": "whether the files' final hidden state is after the final norm (HF hidden_states[-1]) "
                              "or before it"}
    doc = DocRow(
        trainer="home-grown extraction scripts (import only)",
        files="`*.pt`, `*.ckpt`, `*.pth` (also gzipped) anywhere under the folder, one `torch.save` dict",
        tensors="tokens in `input_ids` or `token_ids`; aux states in `aux_hidden_state(s)` [n, kH] or a stacked "
                "`hidden_states` [n, k+1, H]; the final state in `hidden_state(s)` / `last_hidden_state` [n, H] "
                "(or [1, n, ...]); an optional `loss_mask`",
        numbering="decoder layer (as SpecForge)",
        final_state="after the norm, unless the file says `hidden_states_prenorm: True`, holds a stacked "
                    "`hidden_states` (before it), or `--dump-final-state pre_norm` says so for the dump",
        yields="(import only)", vocab="(import only)")

    final_state = "post_norm"  # what files that do not say hold (`hsbuild import --dump-final-state`)

    def scan(self, root: Path) -> list[Path]:
        return files_under(root, lambda name: name.endswith(SUFFIXES))

    def named_sample(self, path: Path) -> str:
        return unquote(path.name.split(".")[0])

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch  # noqa: PLC0415

        from builder.formats.torchfile import int_1d, load_file  # noqa: PLC0415

        d = load_file(path)
        return int_1d(d, TOKENS), (int_1d(d, ("loss_mask",)) if isinstance(d.get("loss_mask"), torch.Tensor) else None)

    def load(self, path: Path) -> Loaded:
        import torch  # noqa: PLC0415

        from builder.formats.torchfile import int_1d, load_file  # noqa: PLC0415

        d = load_file(path)
        ids = int_1d(d, TOKENS)
        mask = int_1d(d, ("loss_mask",)) if isinstance(d.get("loss_mask"), torch.Tensor) else None
        n = ids.shape[0]
        aux_key = next((k for k in AUX if isinstance(d.get(k), torch.Tensor)), None)
        final_key = next((k for k in FINAL if isinstance(d.get(k), torch.Tensor)), None)
        if aux_key is None and final_key == "hidden_states" and d["hidden_states"].dim() == 3 \
                and d["hidden_states"].shape[0] == n:  # stacked [n, k+1, H], vLLM-connector style
            hs = d["hidden_states"]
            return Loaded(ids, mask, hs[:, :-1].reshape(n, -1), hs[:, -1], "pre_norm")
        if aux_key is None or final_key is None:
            raise Rejected("bad_keys", f"has no aux states ({'/'.join(AUX)}) and final state ({'/'.join(FINAL)}) "
                                       f"(keys: {sorted(d)})")
        aux, final = _squeeze(d[aux_key]), _squeeze(d[final_key])
        for key, t in ((aux_key, aux), (final_key, final)):
            if t.dim() != 2 or t.shape[0] != n:
                raise Rejected("bad_shape", f"'{key}' has shape {list(d[key].shape)}, expected [{n}, ...] or "
                                            f"[1, {n}, ...] for its {n} token ids")
        state = "pre_norm" if d.get("hidden_states_prenorm") else self.final_state
        return Loaded(ids, mask, aux, final, state)


def _squeeze(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() == 3 and t.shape[0] == 1 else t
