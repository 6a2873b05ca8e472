"""doctor's checks of an engine backend's server: engine processes left without their server
(env.engine_orphans), and the server itself (env.server: the engine's own checks, found through the registry,
and what doctor sees beside a server that is the build's: other processes holding the GPUs)."""

from __future__ import annotations

import json
from urllib.parse import urlparse

from builder.doctor import checks, gpu, procinfo
from builder.doctor.checks import (
    FAIL,
    OK,
    WARN,
    Check,
    Context,
    Query,
    devices_used,
    explicit_cuda,
    gib,
    meta_of,
    plural,
    spans,
)
from builder.extract.backends import registry as backends
from builder.extract.backends.serving import DoctorRequest, Finding
from builder.humanize import human_bytes
from builder.log.query import run_query
from builder.procfs import listening_pids


def check_engine_orphans(ctx: Context) -> Check:
    """Engine processes whose server is gone (`kill -9` of an API server leaves its engine cores and workers
    running, holding host and GPU memory), or that hold GPU memory under a server that listens on no port; see
    procinfo.engine_orphans (the engines it knows: procinfo.engine_families). Never this process's own
    (ctx.own_pids).

    FAIL (in doctor and in a run's preflight) when orphans (reason 'orphan') hold more than
    ctx.gpu_mem_threshold on one GPU the build uses: for an in-process build the GPUs of its device (as `gpu`),
    for an engine build all visible GPUs (its server's, started by `--launch` or by hand, needs them, and which
    ones it takes cannot be told). An orphan can do no work any more, so ending it is always safe. Else WARN:
    orphans without GPU memory (or without NVML to tell), and 'no_listener' engines (their server may still be
    loading)."""
    inv = gpu.inventory()
    held: dict[int, tuple[int | None, list[int]]] = {}
    for d in inv.devices if inv.available else []:
        for p in d.processes:
            total, where = held.get(p.pid, (None, []))
            if p.used_bytes is not None:
                total = (total or 0) + p.used_bytes
            held[p.pid] = (total, [*where, d.index])
    found = procinfo.engine_orphans(ctx.own_pids, gpu_memory=held if inv.available else None,
                                    cgroup_reader=ctx.cgroup_reader)
    data: dict = {"processes": [o.as_dict() for o in found], "nvml": inv.available}
    if not found:
        names = "/".join(f.name for f in procinfo.engine_families())
        return Check("env.engine_orphans", OK, f"no {names} engine process without its server", data=data)
    engine = backends.of_config(ctx.cfg, ctx.lay.config).server is not None
    usable = (ctx.cuda or checks.cuda_probe())[0]
    gpu_build = explicit_cuda(ctx.device) or (ctx.device == "auto" and usable)
    used = devices_used("cuda" if engine else ctx.device, inv.devices) if (engine or gpu_build) else set()
    orphans = {o.pid for o in found if o.reason == "orphan"}
    blocking = sorted(d.index for d in inv.devices if d.index in used and sum(
        p.used_bytes or 0 for p in d.processes if p.pid in orphans) > ctx.gpu_mem_threshold)
    data.update(devices_used=sorted(used), blocking_gpus=blocking)

    def mem(o: procinfo.EngineOrphan) -> str:
        on = f" on GPU {spans(o.gpus)}" if o.gpus else ""
        return f"RSS {human_bytes(o.rss_bytes)}" + (f", GPU {gib(o.gpu_bytes)}{on}" if o.gpu_bytes else "")

    engines = "/".join(dict.fromkeys(o.engine for o in found))
    parts = []
    for reason in ("orphan", "no_listener"):
        group = [o for o in found if o.reason == reason]
        if not group:
            continue
        procs = ", ".join(f"pid {o.pid} {o.title} ({mem(o)})" for o in group)
        if reason == "orphan":
            parts.append(f"{plural(len(group), f'{engines} engine process', 'es')} left without "
                         f"{'its' if len(group) == 1 else 'their'} server: {procs}")
        else:
            servers = ", ".join(str(s) for s in dict.fromkeys(o.server_pid for o in group))
            parts.append(f"{plural(len(group), f'{engines} engine process', 'es')} holding GPU memory under a "
                         f"server that listens on no port (pid {servers}: hung, or still loading): {procs}")
    summary = "; ".join(parts)
    if len(found) > 1:
        gpu_total = sum(o.gpu_bytes or 0 for o in found)
        summary += f"; {human_bytes(sum(o.rss_bytes for o in found))} RSS in all" + (
            f", {gib(gpu_total)} of GPU memory" if gpu_total else "")
    if blocking:
        summary += f"; GPU {spans(blocking)} of the build's GPUs held by them"
    details = [f"pid {o.pid} {o.title}: parent pid {o.ppid} ({o.parent or '?'})"
               + (f", server pid {o.server_pid}" if o.server_pid else "")
               + (f" [{o.unit.name}]" if o.unit else "") + f", {mem(o)}" for o in found]
    fix = "; ".join(dict.fromkeys(o.kill for o in found))
    return Check("env.engine_orphans", FAIL if blocking else WARN, summary, fix, data, details)


def check_server(ctx: Context) -> list[Check] | None:
    """Engine backends: what the engine finds about its server (`ServerEngine.doctor`: whether it is reachable,
    the build's by its own command line, returning the build's layers); to a server found to be the build's, doctor
    adds the processes other than it (and this one) that hold GPUs: the incident's rogue second server."""
    hooks = backends.of_config(ctx.cfg, ctx.lay.config).server
    if hooks is None:
        return None
    query = ctx.query or (lambda sql: run_query(ctx.lay, sql))  # standalone doctor, before it takes the lock
    req = DoctorRequest(cfg=ctx.cfg, build_root=str(ctx.lay.root), meta=lambda: meta_of(query),
                        first_probe=lambda: first_probe(query), live=ctx.live)
    return [_beside(ctx, f) if f.serving else Check(f.name, f.status, f.summary, f.fix, f.data, f.details)
            for f in hooks.doctor(req)]


def _beside(ctx: Context, f: Finding) -> Check:
    """A server found to be the build's, and the GPU processes that are not its own."""
    url = f.data.get("server") or ctx.cfg.server or "?"
    others = _other_gpu_holders(ctx, url)
    f.data["foreign"] = [o.as_dict() for o in others]
    if not others:
        return Check(f.name, f.status, f.summary, f.fix, f.data, f.details)
    return Check(f.name, WARN, f.summary + f"; but {plural(len(others), 'other process', 'es')} "
                 f"{'holds' if len(others) == 1 else 'hold'} GPUs "
                 f"too (e.g. pid {others[0].pid}: {others[0].command or others[0].name})",
                 "; ".join(dict.fromkeys([*([f.fix] if f.fix else []), *(o.stop_command() for o in others)])),
                 f.data, [*f.details, *(f"pid {o.pid}: {o.command or o.name}" for o in others)])


def first_probe(query: Query) -> dict | None:
    """The detail of the build's first engine_probe event (a run's reference; a re-check's or a trusted one never
    is)."""
    rows = query("SELECT detail FROM events WHERE kind = 'engine_probe' AND coalesce(json_extract(detail, "
                 "'$.recheck')::BOOLEAN, false) = false ORDER BY seq LIMIT 1")[1]
    found = rows[0][0] if rows else None
    return json.loads(found) if isinstance(found, str) else found


def _other_gpu_holders(ctx: Context, url: str) -> list[procinfo.ProcInfo]:
    """GPU processes that are neither the server (the process listening on its port, and its children) nor
    this process."""
    inv = gpu.inventory()
    if not inv.available:
        return []
    port = urlparse(url).port
    server = listening_pids(port) if port else set()
    mine = server | ctx.own_pids
    seen: dict[int, procinfo.ProcInfo] = {}
    for d in inv.devices:
        for p in d.processes:
            if p.pid not in seen and not procinfo.is_ours(p.pid, mine):
                seen[p.pid] = procinfo.describe(p.pid, (), ctx.cgroup_reader, p.name)
    return list(seen.values())
