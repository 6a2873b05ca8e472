"""How many workers `--workers auto` (a new build's default) starts, from what this host has.

What decides is the backend's spec (builder/extract/backends/registry.py), not its name:

- A server backend: one. The server holds the model and runs the passes; one worker keeps its
  in-flight window full.
- The in-process backend on GPUs (`--device auto` or `cuda` with GPUs visible): one worker a visible GPU
  (NVML's count, narrowed by `CUDA_VISIBLE_DEVICES`), as far as half this host's available memory holds
  their copies of the model (each is loaded here before it moves to its GPU); worker i runs on GPU i mod
  their count.
  `--device cuda:N` pins every worker to one GPU: one worker.
- The in-process backend on the CPU: one worker a usable CPU (the affinity mask, lowered to a cgroup CPU
  quota), each with one intra-op thread (a forward pass over a few hundred tokens keeps several threads
  poorly busy, several processes do not), at most CPU_WORKERS_MAX, and no more than half the memory
  available now holds (each worker loads its own copy of the model: its weights in the run's dtype, a quarter
  more for a pass's activations, WORKER_BASE_BYTES for the interpreter and torch beside them).
- A backend whose workers load no model and compute on the CPU (an import reading a dump's files): one worker a
  usable CPU, at most CPU_WORKERS_MAX.

The library decides; the run echoes the count and why (`workers: 2 (auto: ...)`) and records both in its
`run_started` event. A number (`--workers N`, `workers = N` in hsbuild.toml) is always taken as given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import AUTO_WORKERS
from builder.extract.backends import registry as backends
from builder.extract.spec import BuiltinSpec, is_builtin
from builder.procfs import CGROUP, quota_cpus, usable_cpus  # noqa: F401 - (named here too)
from builder.store.dtypes import itemsize

if TYPE_CHECKING:
    from builder.config import BuildConfig
    from builder.extract.backends.registry import BackendSpec

CPU_WORKERS_MAX = 8  # CPU workers `auto` starts at most (each is a process holding the model)
WORKER_BASE_BYTES = 640 << 20  # a worker process beside its model: the interpreter, torch, transformers, buffers
MEMORY_SHARE = 0.5  # of the memory available at the run's start, what `auto`'s CPU workers may take together
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Host:
    """What `auto` sizes against."""
    cpus: int  # usable by this process (its affinity mask, its cgroup's CPU quota)
    mem_available: int | None  # bytes: the kernel's MemAvailable, or the cgroup's room if smaller; None: unknown
    gpus: int  # visible to a worker


@dataclass(frozen=True)
class WorkerCount:
    workers: int
    why: str | None  # one line: what decided it (None: a count given)
    threads: int = 1  # each worker's intra-op threads: the usable CPUs shared among them


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def mem_available() -> int | None:
    """Bytes a new process may still take: /proc/meminfo's MemAvailable, lowered to a cgroup v2 limit's room
    (a container's memory.max less memory.current) where that is smaller. None where neither is readable."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        avail = None
    limit, used = _read_int(CGROUP / "memory.max"), _read_int(CGROUP / "memory.current")
    if limit is not None and used is not None:
        room = max(0, limit - used)
        avail = room if avail is None else min(avail, room)
    return avail


def visible_gpus() -> int:
    """GPUs a worker can see: NVML's device count (0 without the library, a driver or a GPU: CUDA needs the
    driver NVML comes with), narrowed to CUDA_VISIBLE_DEVICES's entries where that is set (empty or -1: none).
    Does not import torch."""
    from builder.doctor.gpu import inventory  # noqa: PLC0415

    inv = inventory(with_processes=False)
    count = len(inv.devices) if inv.available else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or count == 0:
        return count
    entries = [e.strip() for e in env.split(",") if e.strip()]
    if not entries or entries[0].startswith("-"):
        return 0
    return min(len(entries), count)


def host_now(gpus: bool = True) -> Host:
    """This host now; `gpus=False` skips asking NVML (a run that will not use them)."""
    return Host(cpus=usable_cpus(), mem_available=mem_available(), gpus=visible_gpus() if gpus else 0)


def model_bytes(model: str, dtype: str) -> int:
    """The bytes one loaded copy of `model` takes in `dtype`: the built-in model's parameter count, or a
    Hugging Face directory's weight files scaled from their dtype (config.json's torch_dtype) to the run's.
    0 where that cannot be told (the model is then not what limits the count)."""
    size = itemsize(dtype, default=2)
    if is_builtin(model):
        s = BuiltinSpec.parse(model)
        head_dim = s.hidden // s.heads
        layer = (2 * s.hidden + s.hidden * head_dim * (2 * s.heads + 2 * s.kv_heads)
                 + 3 * s.hidden * s.intermediate)
        return size * (s.vocab * s.hidden + s.layers * layer + s.hidden)  # (no LM head: states only)
    root = Path(model)
    if not root.is_dir():
        return 0
    files = [p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    stored = sum(p.stat().st_size for p in (safetensors or files))
    try:
        cfg = json.loads((root / "config.json").read_text())
        stored_size = itemsize(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), default=2)
    except (OSError, ValueError, AttributeError):
        stored_size = 2
    return stored * size // stored_size


def _copies(model_size: int, host: Host) -> tuple[int | None, str]:
    """How many workers' model copies half the available memory holds (None: unknown), and that as words."""
    per_worker = model_size + model_size // 4 + WORKER_BASE_BYTES
    if host.mem_available is None:
        return None, ""
    n = int(host.mem_available * MEMORY_SHARE) // per_worker
    copies = f"{n} copies" if n else "less than one copy"
    return n, (f"memory for {copies} of the model ({per_worker / 2**30:.1f} GiB a worker, half of "
               f"{host.mem_available / 2**30:.1f} GiB available)")


def auto_workers(backend: str, device: str, model_size: int, host: Host) -> WorkerCount:
    """The worker count `--workers auto` stands for (see the module's docstring)."""
    return _auto(backends.get(backend), device, model_size, host)


def _auto(backend: BackendSpec, device: str, model_size: int, host: Host) -> WorkerCount:
    if backend.server:
        return WorkerCount(1, f"the {backend.name} server runs the model; one worker keeps its requests in flight",
                           max(1, host.cpus))
    if device.startswith("cuda:"):
        return WorkerCount(1, f"--device {device} pins the workers to one GPU")
    by_memory, memory = _copies(model_size, host)
    if device in ("auto", "cuda") and host.gpus > 0:
        # each GPU worker loads its copy in this host's memory before moving it to its GPU
        if by_memory is not None and by_memory < host.gpus:
            n = max(1, by_memory)
            return WorkerCount(n, f"{host.gpus} GPUs visible, but {memory}", max(1, host.cpus // n))
        return WorkerCount(host.gpus, f"one a GPU, {host.gpus} visible", max(1, host.cpus // host.gpus))
    n = max(1, min(host.cpus, CPU_WORKERS_MAX, by_memory if by_memory is not None else host.cpus))
    why = f"the CPU: {host.cpus} usable core(s)"
    if by_memory is not None and by_memory < min(host.cpus, CPU_WORKERS_MAX):
        why += f", {memory}"
    elif host.cpus > CPU_WORKERS_MAX:
        why += f", at most {CPU_WORKERS_MAX}"
    return WorkerCount(n, why + f"; {max(1, host.cpus // n)} thread(s) each", max(1, host.cpus // n))


def size(backend: BackendSpec, cfg: BuildConfig, requested: int | str, device: str,
         host: Host | None = None) -> WorkerCount:
    """A run's workers: `requested` (a count, taken as given; or `auto`, this host's rule for `backend` on
    `device`, where its workers compute) and each one's intra-op threads (the usable CPUs shared among them)."""
    if requested != AUTO_WORKERS:
        return WorkerCount(int(requested), None, max(1, (host.cpus if host else usable_cpus()) // int(requested)))
    model_size = model_bytes(cfg.model, cfg.dtype) if backend.loads_model else 0
    host = host or host_now(gpus=backend.loads_model and device in ("auto", "cuda"))
    return _auto(backend, device, model_size, host)


def workers_for(cfg: BuildConfig, device: str | None = None, importing: bool = False,
                host: Host | None = None) -> WorkerCount:
    """`auto` for this build on this host: `device` is the run's (--device), else the config's. An import's
    workers read dumped files and load no model."""
    backend = backends.for_run(cfg, importing)
    return size(backend, cfg, AUTO_WORKERS, backend.device or device or cfg.device, host)
