"""The layer numberings trainers and engines use: one rule (`layer_numberings`) turns a build's aux layers into
each of them; every export's journal and the build's metadata carry all of them, an import's claim is read in
one of them, and each format names the one its trainer's configs use (`TrainerFormat.layer_convention`)."""

from __future__ import annotations

# numbering -> (its short name for --dump-layer-convention, how a report names its ids)
NUMBERINGS = {
    # Hugging Face output_hidden_states index: 0 is the embeddings, k the output of decoder layer k-1
    "hf_hidden_states": ("hf", "HF hidden_states indices"),
    # SpecForge / Model-Optimizer / EAGLE-3 configs ("eagle_aux_hidden_state_layer_ids"): decoder layer index
    "decoder_layer_output": ("decoder", "decoder-layer ids"),
    # vLLM's extract_hidden_states layer ids: k = hidden_states[k] (L is the final state before the norm)
    "vllm_eagle_aux_hidden_state_layer_ids": ("vllm", "vLLM layer ids"),
}
CONVENTIONS = {short: full for full, (short, _) in NUMBERINGS.items()}  # short name -> numbering
LAYER_CONVENTIONS = (*NUMBERINGS, *CONVENTIONS)  # what --dump-layer-convention takes


def layer_numberings(aux_layers: list[int] | tuple[int, ...], num_layers: int) -> dict[str, list[int]]:
    """The aux layers (Hugging Face hidden_states indices), then the final state, of a `num_layers`-layer model in
    each numbering trainers and engines use (what an export's journal records and an import's claim is read in)."""
    L, aux = num_layers, list(aux_layers)
    return {
        "hf_hidden_states": [*aux, L],
        "decoder_layer_output": [i - 1 for i in aux] + [L - 1],
        "vllm_eagle_aux_hidden_state_layer_ids": [*aux, L],
    }


def ids_name(numbering: str) -> str:
    """How a report names ids of `numbering`: "decoder-layer ids"."""
    return NUMBERINGS[numbering][1]
