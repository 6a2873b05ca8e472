"""What a vLLM server returns for a build: the layer ids it is asked for, and the least a staging file of them
takes (`token_ids` int64 [T], `hidden_states` [T, len(ids), H] of the build's dtype, in a safetensors file).

Layer ids: engine id k < L is Hugging Face `hidden_states[k]`; id L is the last decoder layer's output BEFORE
the final norm (Hugging Face's `hidden_states[L]` is after it).
"""

from __future__ import annotations

# a request's kv_transfer_params key asking hsbuild's connector to stage nothing for it (an earlier turn of a
# regeneration: only its tokens are needed; builder/extract/backends/vllm/connector.py)
SKIP_STATES = "hsbuild_skip_states"


def engine_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """The ids the server is asked for: the aux layers (HF indices < L, the same ids in vLLM) and L."""
    return sorted(set(aux_layers) | {num_layers})


def staged_file_bytes(tokens: int, slots: int, hidden: int, dtype: str) -> int:
    """The least a staging file of `tokens` tokens takes: its tensors' bytes (token ids int64, hidden states
    [tokens, slots, hidden] of `dtype`) and the 8 bytes of its header's length; the header and the filesystem's
    blocks only add to it."""
    from builder.store.dtypes import itemsize  # noqa: PLC0415 - (numpy: not when the backends' specs are read)

    return 8 + tokens * 8 + tokens * slots * hidden * itemsize(dtype)
