"""The individual `doctor` checks. Each returns typed `Check`s; none prints, none raises for what it finds.

A check's status: 'ok', 'warn' (worth knowing, not blocking) or 'fail' (blocking: `run`/`resume` refuse to
start unless --force). See docs/doctor.md.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builder.config import BuildConfig, format_change_message
from builder.doctor import gpu, procinfo
from builder.errors import HsbuildError
from builder.extract.arrow_source import is_dataset_dir
from builder.extract.spec import is_builtin
from builder.humanize import human_bytes
from builder.layout import BuildLayout
from builder.log.lock import LockState, pid_alive
from builder.log.query import jsonable

OK, WARN, FAIL = "ok", "warn", "fail"
GPU_MEM_THRESHOLD = 1 << 30  # foreign GPU memory above this on a device the build uses is blocking
MAX_FINGERPRINT_PARAMS = 50_000_000  # builtin models above this are not rebuilt just to fingerprint them

Query = Callable[[str], tuple[list[str], list[list]]]


@dataclass
class Check:
    name: str
    status: str  # 'ok' | 'warn' | 'fail'
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)
    details: list[str] = field(default_factory=list)  # extra lines for people (one per foreign process, ...)

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, "fix": self.fix,
                "details": self.details, "data": jsonable(self.data)}


@dataclass
class Context:
    lay: BuildLayout
    cfg: BuildConfig
    device: str  # the device the run would use (flag or config)
    own_pids: set[int]
    for_run: bool  # preflight of a run that holds the lock (True) or standalone doctor (False)
    query: Query | None = None  # build-state SQL; None when the log cannot be read
    query_error: str | None = None
    live: bool = False  # a run owns the build right now (standalone doctor while it runs)
    gpu_mem_threshold: int = GPU_MEM_THRESHOLD
    cgroup_reader: Callable[[int], str | None] | None = None
    cuda: tuple[bool, int, str] | None = None  # (usable, device count, description); filled by env checks
    model_fp: tuple[str | None, str | None] | None = None  # (fingerprint, error), computed before the lock


def plural(n: int, word: str, suffix: str = "s") -> str:
    return f"{n} {word}{'' if n == 1 else suffix}"


def spans(nums: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5'."""
    ns, out, i = sorted(set(nums)), [], 0
    while i < len(ns):
        j = i
        while j + 1 < len(ns) and ns[j + 1] == ns[j] + 1:
            j += 1
        out.append(str(ns[i]) if i == j else f"{ns[i]}-{ns[j]}")
        i = j + 1
    return ",".join(out)


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


# ---------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------


def torch_build(path: Path | None = None) -> dict | None:
    """torch's build description (`torch/version.py`, or `path`: __version__, cuda, hip, ...) read without
    importing torch (seconds of a run's start-up); None if it cannot be read that way."""
    if path is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    out: dict = {}
    for node in tree.body:  # `name = constant` and `name: type = constant`
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            out[target.id] = node.value.value
    return out if "__version__" in out and "cuda" in out else None


def cuda_probe() -> tuple[bool, int, str]:
    """(CUDA usable by torch, device count, 'torch X (CUDA Y)'). The boundary tests substitute.
    A CPU-only build of torch (no CUDA, ROCm or XPU in its build description) cannot use CUDA: that is answered
    without importing torch; any other build is asked."""
    build = torch_build()
    if build is not None and not any(build.get(k) for k in ("cuda", "hip", "rocm", "xpu")):
        return False, 0, f"torch {build['__version__']} (CPU-only build)"
    import torch  # noqa: PLC0415

    usable = bool(torch.cuda.is_available())
    count = torch.cuda.device_count() if usable else 0
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return usable, count, f"torch {torch.__version__} ({built})"


def check_torch(ctx: Context) -> Check:
    try:
        ctx.cuda = cuda_probe()
    except Exception as e:  # noqa: BLE001 - a broken torch install is a finding, not a crash
        ctx.cuda = (False, 0, "torch unusable")
        return Check("env.torch", FAIL, f"torch does not import ({type(e).__name__}: {e})",
                     "reinstall hsbuild's dependencies (pip install hsbuild)")
    usable, count, desc = ctx.cuda
    cuda = f"CUDA usable, {plural(count, 'device')}" if usable else "CUDA not usable"
    return Check("env.torch", OK, f"{desc}; {cuda}", data={"description": desc, "cuda_usable": usable,
                                                             "cuda_devices": count})


def check_model(ctx: Context) -> Check:
    spec = ctx.cfg.model
    if is_builtin(spec):
        from builder.extract.spec import BuiltinSpec  # noqa: PLC0415

        try:
            s = BuiltinSpec.parse(spec)
        except HsbuildError as e:
            return Check("env.model", FAIL, str(e), "fix `model` in hsbuild.toml (see `hsbuild init --help`)")
        return Check("env.model", OK, f"built-in model: {s.layers} layers, hidden {s.hidden}, vocab {s.vocab}",
                     data={"model": spec, "kind": "builtin"})
    path = Path(spec)
    fix = "point `model` in hsbuild.toml at a Hugging Face model directory (with config.json), or restore it"
    if not path.is_dir():
        return Check("env.model", FAIL, f"model directory {spec} does not exist", fix, {"model": spec})
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return Check("env.model", FAIL, f"{spec}/config.json is not readable JSON ({type(e).__name__}: {e})", fix,
                     {"model": spec})
    data = {"model": spec, "kind": "hf", "model_type": hf.get("model_type"),
            "num_hidden_layers": hf.get("num_hidden_layers"), "hidden_size": hf.get("hidden_size")}
    if importlib.util.find_spec("transformers") is None:
        return Check("env.model", FAIL, f"{spec} is a Hugging Face model but transformers is not installed",
                     "pip install 'hsbuild[hf]'", data)
    return Check("env.model", OK, f"Hugging Face model {hf.get('model_type', '?')}: "
                 f"{hf.get('num_hidden_layers', '?')} layers, hidden {hf.get('hidden_size', '?')}", data=data)


def check_source(ctx: Context) -> Check:
    src = Path(ctx.cfg.source)
    if src.is_file():
        return Check("env.source", OK, f"source {src} ({human_bytes(src.stat().st_size)})", data={"path": str(src)})
    if src.is_dir() and is_dataset_dir(src):
        size = sum(p.stat().st_size for p in src.glob("*.arrow"))
        return Check("env.source", OK, f"source {src} (a datasets directory, {human_bytes(size)})",
                     data={"path": str(src)})
    return Check("env.source", FAIL, f"source {src} is missing",
                 "if it moved: hsbuild resume BUILD --source NEWPATH (recorded in the log); else restore the file at "
                 "that path (its samples are registered in the build)",
                 {"path": str(src)})


# ---------------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------------


def explicit_cuda(device: str) -> bool:
    return device.startswith("cuda")


def devices_used(device: str, devs: list[gpu.GpuDevice]) -> set[int]:
    """NVML indices the build may extract on: all visible for cuda/auto, the one named for cuda:N."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [d.index for d in devs]
    if visible is not None:
        order = []
        for tok in filter(None, (t.strip() for t in visible.split(","))):
            if tok.isdigit():
                order.append(int(tok))
            else:
                order += [d.index for d in devs if d.uuid and d.uuid.startswith(tok)]
    if ":" in device:
        try:
            n = int(device.split(":", 1)[1])
        except ValueError:
            return set(order)
        return {order[n]} if n < len(order) else set()
    return set(order)


def check_gpus(ctx: Context) -> list[Check]:
    usable, _count, desc = ctx.cuda or cuda_probe()
    explicit = explicit_cuda(ctx.device)
    gpu_build = explicit or (ctx.device == "auto" and usable)
    inv = gpu.inventory()
    mode = {"device": ctx.device, "gpu_build": gpu_build, "cuda_usable": usable}
    if not inv.available or not inv.devices:
        reason = inv.reason or "NVML sees no GPU"
        data = {**mode, "nvml": inv.available, "reason": reason, "driver": inv.driver, "devices": 0}
        if not explicit:
            return [Check("gpu", OK, f"{reason}: CPU mode (device {ctx.device})", data=data)]
        if usable:
            return [Check("gpu", WARN, f"{reason}, although torch can use CUDA: GPU processes cannot be inspected",
                          "install nvidia-ml-py and make libnvidia-ml.so visible to inspect GPU use", data)]
        return [Check("gpu", FAIL, f"{reason}: CPU mode, but the build's device is {ctx.device}",
                      "run on a machine with a GPU, or pass --device cpu (or set device = \"cpu\")", data)]

    used = devices_used(ctx.device, inv.devices) if gpu_build else set()
    checks: list[Check] = []
    holders: dict[str, dict] = {}  # stop command -> who and where, across devices
    blocking = 0
    for d in inv.devices:
        c = _device_check(ctx, d, gpu_build, gpu_build and d.index in used, holders)
        blocking += c.status == FAIL
        checks.append(c)

    where = "on GPU" if gpu_build else "on CPU"
    head = (f"{plural(len(inv.devices), 'GPU')}, driver {inv.driver or '?'}; the build extracts {where} "
            f"(device {ctx.device})")
    data = {**mode, "nvml": True, "driver": inv.driver, "devices": len(inv.devices), "devices_used": sorted(used),
            "foreign": list(holders.values())}
    if explicit and not usable:
        checks.insert(0, Check("gpu", FAIL, f"{head}, but {desc} cannot use CUDA",
                               "install a CUDA build of torch, or pass --device cpu", data))
        return checks
    if holders:
        units = ", ".join(f"{h['who']} ({plural(len(h['pids']), 'process', 'es')}, {gib(h['bytes'])} on "
                          f"{'GPU' if len(set(h['gpus'])) == 1 else 'GPUs'} {spans(h['gpus'])})"
                          for h in holders.values())
        warned = any(c.status == WARN and c.data.get("foreign_bytes") for c in checks)
        status = FAIL if blocking else WARN if warned else OK
        fix = "; ".join(holders) if status != OK else None
        checks.insert(0, Check("gpu", status, f"{head}; held by foreign processes: {units}", fix, data))
    else:
        checks.insert(0, Check("gpu", OK, head, data=data))
    return checks


def _device_check(ctx: Context, d: gpu.GpuDevice, gpu_build: bool, in_use: bool,
                  holders: dict[str, dict]) -> Check:
    name = f"gpu{d.index}"
    mem = f"{gib(d.mem_used)} of {gib(d.mem_total)} used"
    data: dict = {"index": d.index, "name": d.name, "uuid": d.uuid, "mem_used": d.mem_used,
                  "mem_total": d.mem_total, "util_percent": d.util_percent, "used_by_build": in_use,
                  "errors": d.errors, "processes": []}
    foreign_bytes, listed_bytes, details, fixes = 0, 0, [], []
    for p in d.processes:
        info = procinfo.describe(p.pid, ctx.own_pids, ctx.cgroup_reader, name=p.name)
        data["processes"].append({**info.as_dict(), "used_bytes": p.used_bytes})
        listed_bytes += p.used_bytes or 0
        if info.ours:
            continue
        foreign_bytes += p.used_bytes or 0
        stop = info.stop_command()
        if stop not in fixes:
            fixes.append(stop)
        who = info.unit.name if info.unit else f"pid {p.pid}"
        h = holders.setdefault(stop, {"who": who, "stop": stop, "pids": [], "gpus": [], "bytes": 0})
        h["pids"].append(p.pid)
        h["gpus"].append(d.index)
        h["bytes"] += p.used_bytes or 0
        unit = f" [{info.unit.name}]" if info.unit else ""
        cmd = "not visible here (another PID namespace: look on the host)" if not info.visible else "?"
        details.append(f"pid {p.pid}{unit} {gib(p.used_bytes)}: {info.command or info.name or cmd}")
    data["foreign_bytes"] = foreign_bytes
    failed = f"; query failed ({'; '.join(d.errors)})" if d.errors else ""
    if foreign_bytes > ctx.gpu_mem_threshold:
        n = sum(1 for p in data["processes"] if not p["ours"])
        summary = f"{d.name}: {mem}, {gib(foreign_bytes)} by {plural(n, 'foreign process', 'es')}{failed}"
        if in_use:
            return Check(name, FAIL, summary, "; ".join(fixes), data, details)
        if gpu_build:
            return Check(name, WARN, summary + " (the build does not use this GPU)", "; ".join(fixes), data,
                         details)
        return Check(name, OK, summary + " (a CPU build: no matter)", data=data, details=details)
    if d.errors:
        return Check(name, WARN, f"{d.name}: {mem}{failed}",
                     "check the device with nvidia-smi; reset or replace it if it stays unreadable", data, details)
    unlisted = (d.mem_used or 0) - listed_bytes
    if not d.processes and unlisted > ctx.gpu_mem_threshold and in_use:
        return Check(name, WARN, f"{d.name}: {mem} by processes NVML does not list (another container or VM?)",
                     "find the holder with nvidia-smi on the host", data, details)
    note = f", {plural(len(details), 'small foreign process', 'es')}" if details else ""
    util = f", {d.util_percent}% busy" if d.util_percent is not None else ""
    return Check(name, OK, f"{d.name}: {mem}{util}{note}", data=data, details=details)


def meta_of(q: Query) -> dict:
    return {k: json.loads(v) for k, v in q("SELECT key, value FROM meta")[1]}


# ---------------------------------------------------------------------------------------------------
# Build state
# ---------------------------------------------------------------------------------------------------


def check_lock(ctx: Context, state: LockState | None, previous_owner: dict | None) -> Check:
    """Standalone: `state` from inspect_lock before anything else. In a run: the dead owner the run took over."""
    if ctx.for_run:
        if previous_owner:
            return _stale(previous_owner, taken_over=True)
        return Check("build.lock", OK, "held by this run; the previous owner exited cleanly")
    if state is None or (not state.held and not state.info):
        return Check("build.lock", OK, "free: no run is going")
    if state.held:
        info = state.info or {}
        return Check("build.lock", OK, f"a {info.get('purpose', 'run')} is going: pid {info.get('pid', '?')}"
                     f" (run {str(info.get('run_id') or '?')[:8]}); build state comes from it",
                     data={"held": True, **info})
    return _stale(state.info or {}, taken_over=False)


def _stale(info: dict, taken_over: bool) -> Check:
    pid = info.get("pid")
    host = info.get("host")
    here = host in (None, socket.gethostname())
    alive = bool(pid) and here and pid_alive(int(pid))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started_at"])) if info.get("started_at") else "?"
    who = (f"{info.get('purpose', 'run')} pid {pid} (run {str(info.get('run_id') or '?')[:8]}, started {when}"
           + ("" if here else f", host {host}") + ")")
    if not here:
        data = {"held": False, "stale": None, "pid": pid, "pid_alive": None, "host": host, "owner": info,
                "safe_to_take_over": False, "taken_over": taken_over}
        if taken_over:
            return Check("build.lock", WARN, f"took over the lock of {who} (--take-over)",
                         f"make sure nothing runs on this build on {host}", data)
        return Check("build.lock", WARN, f"lock record of {who}, never released: a lock held on another host may "
                     "be invisible here, so runs refuse to start", f"make sure it does not run on {host}, then pass "
                     "--take-over to run/resume/verify/gc", data)
    if alive:
        state = f"no longer holds it (pid {pid} now belongs to another process)"
    else:
        state = "is dead (killed or crashed)"
    data = {"held": False, "stale": True, "pid": pid, "pid_alive": alive, "owner": info,
            "safe_to_take_over": True, "taken_over": taken_over}
    stopped = interrupted_how(info)
    if stopped:  # the owner exited at once on a user's request (a second Ctrl-C): not a crash
        data["interrupted"] = info["interrupted"]
        if taken_over:
            return Check("build.lock", OK, f"took over the lock of {who}, which was interrupted ({stopped}): not a "
                         "crash", data=data)
        return Check("build.lock", OK, f"lock record of {who}, interrupted ({stopped}): not a crash; safe to take "
                     "over", "nothing to do: the next `hsbuild run` / `hsbuild resume` takes it over", data)
    if taken_over:
        return Check("build.lock", WARN, f"took over a stale lock: {who} {state}; safe",
                     "nothing to do; see why it stopped (dmesg for the OOM killer, journalctl)", data)
    return Check("build.lock", WARN, f"stale lock: {who} {state}; safe to take over",
                 "nothing to do: the next `hsbuild run` / `hsbuild resume` takes it over", data)


def interrupted_how(owner: dict | None) -> str | None:
    """How a dead owner's lock record says it was interrupted on purpose (`note_interrupted`), else None."""
    mark = (owner or {}).get("interrupted")
    if not isinstance(mark, dict):
        return None
    sig = mark.get("signal")
    how = {"SIGINT": "Ctrl-C twice", "SIGTERM": "a second SIGTERM"}.get(sig, f"signal {sig}")
    at = mark.get("at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, int | float) else None
    return how + (f" at {when}" if when else "")


def check_interrupted(ctx: Context, last_owner: dict | None = None) -> Check:
    """Samples left `started`. `last_owner`: the lock record of the owner that did not release the build, if
    any (an interrupted run is named as such, not as a crash)."""
    assert ctx.query is not None
    n = int(ctx.query("SELECT count(*) FROM samples WHERE state = 'started'")[1][0][0] or 0)
    data = {"started": n, "live": ctx.live}
    if not n:
        return Check("build.interrupted", OK, "no samples left in flight", data=data)
    if ctx.live:
        return Check("build.interrupted", OK, f"{plural(n, 'sample')} in flight in the running run", data=data)
    them, they = ("it", "it is") if n == 1 else ("them", "they are")
    stopped = interrupted_how(last_owner)
    why = f"was interrupted ({stopped})" if stopped else "stopped abruptly (crash or kill)"
    data["interrupted_by_user"] = bool(stopped)
    if ctx.for_run:  # this run's preflight: it is the one that extracts them again; nothing to tell the user to run
        return Check("build.interrupted", WARN, f"{plural(n, 'sample')} left `started` by a run that {why} before "
                     f"finishing {them}; this run extracts {them} again", None, data)
    return Check("build.interrupted", WARN, f"{plural(n, 'sample')} left `started` by a run that {why} before "
                 f"finishing {them}; {they} extracted again", f"hsbuild resume {ctx.lay.root}", data)


def check_failed(ctx: Context) -> Check:
    assert ctx.query is not None
    m = int(ctx.cfg.max_attempts)
    rows = ctx.query("SELECT coalesce(error, '?'), count(*), count(*) FILTER (WHERE attempts < "
                     f"{m}) FROM samples WHERE state = 'failed' GROUP BY 1 ORDER BY 2 DESC, 1")[1]
    by_reason = {r[0]: int(r[1]) for r in rows}
    retry = sum(int(r[2]) for r in rows)
    total = sum(by_reason.values())
    data = {"failed": total, "by_reason": by_reason, "to_retry": retry, "max_attempts": m}
    if not total:
        return Check("build.failed", OK, "no failed samples", data=data)
    reasons = ", ".join(f"{k}: {v}" for k, v in by_reason.items())
    sql = "SELECT sample_id, error, error_detail FROM samples WHERE state = 'failed'"
    return Check("build.failed", WARN, f"{plural(total, 'failed sample')} ({reasons}); {retry} will be retried "
                 f"(fewer than {m} attempts)", f"inspect {'it' if total == 1 else 'them'}: hsbuild sql {ctx.lay.root} \"{sql}\"", data)


def _builtin_params(spec: str) -> int:
    from builder.extract.spec import BuiltinSpec  # noqa: PLC0415

    s = BuiltinSpec.parse(spec)
    per_layer = 4 * s.hidden * s.hidden + 3 * s.hidden * s.intermediate
    return s.vocab * s.hidden + s.layers * per_layer


def model_fingerprint(cfg: BuildConfig) -> str | None:
    """The model's fingerprint where that is cheap: a small builtin model, or a Hugging Face directory (its
    files' content digests are cached, so only a changed file is read again); None otherwise."""
    if not is_builtin(cfg.model):
        if not (Path(cfg.model) / "config.json").is_file():
            return None  # env.model reports it
        from builder.extract.weights import directory_fingerprint  # noqa: PLC0415

        return directory_fingerprint(cfg.model)
    if _builtin_params(cfg.model) > MAX_FINGERPRINT_PARAMS:
        return None
    from builder.extract.model import Extractor  # noqa: PLC0415

    return Extractor(cfg.model, cfg.aux_layers or None, cfg.dtype, device="cpu").fingerprint


def prepare_model_fingerprint(ctx: Context) -> tuple[str | None, str | None]:
    """(fingerprint, error): done before standalone doctor takes the build lock, so it holds it briefly.
    A run's preflight leaves a builtin model to its workers: each fingerprints the model it loads, and the run
    refuses one that differs from the build's before any sample (builder/run/handling.py); building it here too
    would import torch into the coordinator for nothing (a Hugging Face directory's digests are cached: kept)."""
    if ctx.for_run and is_builtin(ctx.cfg.model):
        ctx.model_fp = (None, None)
        return ctx.model_fp
    try:
        ctx.model_fp = (model_fingerprint(ctx.cfg), None)
    except HsbuildError as e:
        ctx.model_fp = (None, str(e))
    return ctx.model_fp


def check_fingerprints(ctx: Context) -> Check:
    """The config's format keys and the model against the build's. Either differing is never overridable:
    a build holds one format (run refuses whatever --force says)."""
    assert ctx.query is not None
    meta = meta_of(ctx.query)
    want_cfg, have_cfg = meta.get("config_fingerprint"), ctx.cfg.fingerprint()
    changes = ctx.cfg.format_changes(meta)
    data: dict = {"config_fingerprint": have_cfg, "build_config_fingerprint": want_cfg,
                  "build_model_fingerprint": meta.get("model_fingerprint"), "changed_keys": sorted(changes),
                  "overridable": False}
    problems = []
    if changes:
        problems.append(format_change_message(changes))
    fp, err = ctx.model_fp or prepare_model_fingerprint(ctx)
    if err:
        data["model_error"] = err
    data["model_fingerprint"] = fp
    if fp is not None and meta.get("model_fingerprint") and fp != meta["model_fingerprint"]:
        problems.append(f"model fingerprint {fp} differs from the build's {meta['model_fingerprint']}: the model's "
                        "files changed since `init`")
    if problems:
        return Check("build.fingerprint", FAIL, "; ".join(problems),
                     "restore hsbuild.toml and the model as they were at `init`, or start a new build with "
                     "`hsbuild init NEWDIR --source ...` (--force does not override this)", data)
    how = "config and model match the build" if fp else "config matches the build (model checked when loaded)"
    return Check("build.fingerprint", OK, how, data=data)
