"""The vLLM backend: forward passes in a running vLLM server, states ingested from its staging folder. Everything
hsbuild knows about vLLM is in this package (docs/design.md section 12); the rest of hsbuild reaches it only
through the registry, by the name `vllm`.

- `backend`: the request path (VllmBackend: requests in flight, staging files read, validated, deleted);
- `generate`: a regenerating build's request (generation and states in one pass) and what its answer must say;
- `states`: the layer ids the server is asked for, and the least a staging file takes;
- `command`: the server command (`serve-command`, `run --launch`), and what init checks of a vLLM build;
- `probe`, `identity`: the check that a running server is the build's (its command line, /v1/models, a probe);
- `doctor`: doctor's env.server;
- `hooks`: the server hooks the core calls (plan, identity, doctor, processes, Ray placement);
- `connector`: hsbuild's KV connectors, loaded by the server (`kv_connector_module_path`), never by hsbuild.

This module is the backend's spec, read by init and the CLI: it imports neither torch, numpy nor vLLM.
"""

from __future__ import annotations

from pathlib import Path

from builder.extract.backends.registry import BackendSpec, RunContext, register
from builder.extract.backends.vllm.hooks import VllmServer

DEFAULT_INFLIGHT = 16  # requests in flight to the server (hsbuild.toml `inflight`, run --inflight)


def _check_init(ex) -> dict:  # noqa: ANN001 - (Extractor or ModelInfo)
    from builder.extract.backends.vllm.command import check_init  # noqa: PLC0415

    return check_init(ex)


def worker_settings(ctx: RunContext):  # noqa: ANN201 - (VllmSettings)
    """The workers' settings: `ctx.staging_dir` is the build's own subfolder of its server's staging folder."""
    from builder.extract.backends.vllm.backend import VllmSettings  # noqa: PLC0415

    cfg, meta = ctx.cfg, ctx.meta
    return VllmSettings(server=cfg.server or "", model_name=ctx.model_name, staging=str(ctx.staging_dir),
                        aux_layers=list(meta["aux_layers"]), num_layers=int(meta["num_layers"]),
                        hidden_size=int(meta["hidden_size"]), dtype=cfg.dtype, final_state=cfg.final_state,
                        inflight=int(BACKEND.setting(cfg, "inflight")))


def _open(settings, recheck=None):  # noqa: ANN001, ANN202 - (WorkerSettings)
    """The model's metadata only (token checks; the server holds the weights), and the build's final norm
    (post-norm states from the server's pre-norm ones)."""
    from builder.extract.backends.vllm.backend import VllmBackend  # noqa: PLC0415
    from builder.extract.model import Extractor  # noqa: PLC0415
    from builder.formats.final_state import FinalNorm  # noqa: PLC0415

    ex = Extractor(settings.model, settings.aux_layers or None, settings.dtype, "cpu", load_weights=False)
    norm = FinalNorm.load(Path(settings.final_norm)) if settings.final_norm else None
    return ex, VllmBackend(settings.backend_settings, norm, recheck)


def _generation_problem(settings) -> str | None:  # noqa: ANN001 - (a mapping)
    from builder.extract.backends.vllm.generate import generation_problem  # noqa: PLC0415

    return generation_problem(settings)


BACKEND = register(BackendSpec(
    name="vllm", summary="a vLLM server runs the model", open=_open, server=VllmServer(), device="cpu",
    final_state="pre_norm", options={"server": None, "inflight": DEFAULT_INFLIGHT},
    check_init=_check_init, worker_settings=worker_settings, generates=True,
    generation_problem=_generation_problem))
