"""The vLLM server as the core drives it (builder/extract/backends/serving.py, ServerEngine): its plan (the
command: command.py), its identity check (identity.py), doctor's env.server (doctor.py), how its processes look
in /proc (env.engine_orphans), and its place on a Ray node. Cheap to import: the spec holds an instance."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.extract.backends.serving import (
    DoctorRequest,
    EngineProcesses,
    Finding,
    IdentityRequest,
    ServerEngine,
)

if TYPE_CHECKING:
    from builder.config import BuildConfig
    from builder.extract.backends.vllm.command import EngineSpec
    from builder.extract.backends.vllm.identity import VllmIdentity

# vLLM titles its processes with setproctitle as PREFIX::NAME: `VLLM::EngineCore`, `VLLM::EngineCore_DP0`,
# `VLLM::Worker`, `VLLM::Worker_TP0`, `VLLM::DPCoordinator`, and its extra API servers `VLLM::APIServer_0`
# (vllm/utils/system_utils.py set_process_title; the prefix is VLLM_PROCESS_NAME_PREFIX). Its servers run
# `python -m vllm.entrypoints.openai.api_server` or the console script `vllm serve`.
PROCESSES = EngineProcesses(family="vllm", name="vLLM", title_prefixes=("VLLM",), prefix_env="VLLM_PROCESS_NAME_PREFIX",
                            server_titles=("APIServer",), modules=("vllm",), scripts=("vllm",))


class VllmServer(ServerEngine):
    processes = PROCESSES

    def plan(self, cfg: BuildConfig, meta: dict) -> EngineSpec:
        from builder.extract.backends.vllm.command import engine_spec  # noqa: PLC0415

        return engine_spec(cfg, meta)

    def identity(self, request: IdentityRequest) -> VllmIdentity:
        from builder.extract.backends.vllm.identity import Expected, VllmIdentity  # noqa: PLC0415

        plan: EngineSpec = request.plan  # type: ignore[assignment]
        return VllmIdentity(server=plan.server,
                            expected=Expected(model=plan.model, layer_ids=list(plan.layer_ids), staging=plan.staging,
                                              dtype=request.cfg.dtype),
                            staging_dir=request.staging_dir, vocab_size=int(request.meta["vocab_size"]),
                            hidden_size=int(request.meta["hidden_size"]), build_root=request.build_root,
                            reference=(request.recorded or {}).get("signature"), trust=request.trust)

    def doctor(self, request: DoctorRequest) -> list[Finding]:
        from builder.extract.backends.vllm.doctor import server_finding  # noqa: PLC0415

        return [server_finding(request)]

    def placement(self, node: dict, launch: bool) -> dict[str, float]:
        """A launched server takes every GPU of its node (tensor parallel: `engine_args`); in connect mode the
        GPUs are the server's, which hsbuild does not start, so its actor reserves none."""
        return {"num_cpus": 0, "num_gpus": float(node.get("Resources", {}).get("GPU", 0)) if launch else 0.0}
