"""The probe of a vLLM server: one request with a fixed prompt, whose staging file says which layer slots, hidden
size and dtype the server returns, and the per-token, per-slot norms of its states (a signature: the same model
and layers give the same within a fraction of a percent; another far off)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from builder.errors import UsageError
from builder.extract.backends.http_client import complete, served_model
from builder.extract.backends.staging import read_and_remove

PROBE_TOKENS = 16


@dataclass(frozen=True)
class ProbeResult:
    model_id: str
    root: str
    layers: int  # layer slots the server returned
    hidden: int
    dtype: str
    signature: list[list[float]]  # per token, per slot: the L2 norm of the state (float32)


def probe_ids(vocab_size: int) -> list[int]:
    """A fixed prompt any model can take: the same for every probe of a build."""
    return [(7 + 31 * i) % vocab_size for i in range(PROBE_TOKENS)]


def probe(server: str, vocab_size: int, timeout: float = 120.0, staging: str | Path | None = None) -> ProbeResult:
    """One request with a fixed prompt: which model, which layers, which dtype the server returns (its staging
    file is read, then deleted). `staging`: the build's own staging subfolder, where the request names its file;
    a server that writes elsewhere is refused (UsageError)."""
    import torch  # noqa: PLC0415

    m = served_model(server)
    want = None if staging is None else Path(staging) / f"probe-{uuid.uuid4().hex}.safetensors"
    doc = complete(server, m.id, probe_ids(vocab_size), timeout,
                   {"hidden_states_path": str(want)} if want is not None else None)
    path = (doc.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise UsageError(f"{server}: answers without a hidden_states_path: it does not run the extract_hidden_states "
                         "method with the hidden-states connector; start it with `hsbuild serve-command BUILD`")
    if want is not None and Path(path) != want:
        raise UsageError(f"{server}: wrote the probe's states to {path}, not to the file it was asked for in the "
                         f"build's staging folder {staging}: its connector does not stage per build; start it with "
                         "`hsbuild serve-command BUILD`")
    data = read_and_remove(path, timeout)
    hs = data["hidden_states"]
    norms = torch.linalg.vector_norm(hs.to(torch.float32), dim=-1)  # [T, slots]
    return ProbeResult(m.id, m.root, int(hs.shape[1]), int(hs.shape[2]), str(hs.dtype).replace("torch.", ""),
                       np.round(norms.numpy().astype(np.float64), 4).tolist())


def probe_problems(p: ProbeResult, layer_ids: list[int], hidden: int, dtype: str) -> list[str]:
    """What in a probe's answer does not fit a build: its layer slots, hidden size, dtype."""
    problems = []
    if p.layers != len(layer_ids):
        problems.append(f"returns {p.layers} layer slots, the build needs {len(layer_ids)} (ids {layer_ids})")
    if p.hidden != hidden:
        problems.append(f"returns hidden size {p.hidden}, the build's model has {hidden}")
    if p.dtype != dtype:
        problems.append(f"returns {p.dtype} states, the build stores {dtype}")
    return problems


def signature_differs(a: list[list[float]], b: list[list[float]], rtol: float = 0.05) -> float | None:
    """The largest relative difference between two probe signatures, when above `rtol` (another model or other
    layers: far above; the same model in another batch: a fraction of a percent)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        return float("inf")
    rel = float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-6)))
    return rel if rel > rtol else None
