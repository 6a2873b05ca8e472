"""GPUs through NVML (nvidia-ml-py, `import pynvml`), loaded lazily and never fatal.

`_nvml()` is the one boundary to the library: tests substitute a fake module there (there is no GPU on the
development machines or in CI). Without the library, without a driver or without a GPU, `inventory()` says
why in `GpuInventory.reason` and `gpu_stats()` returns [].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

_initialised: list[ModuleType] = []  # NVML modules whose nvmlInit() succeeded in this process


def _nvml() -> ModuleType:
    """The NVML module (pynvml). Raises ImportError when nvidia-ml-py is not installed."""
    import pynvml  # noqa: PLC0415 - lazy: importing is cheap, but a CPU-only install may lack it

    return pynvml


@dataclass
class GpuProcess:
    pid: int
    name: str | None  # NVML's process name (usually the executable path)
    used_bytes: int | None  # None where the driver does not say (MIG, some containers)


@dataclass
class GpuDevice:
    index: int
    name: str = "?"
    uuid: str | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    util_percent: int | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # queries that failed on this device


@dataclass
class GpuInventory:
    available: bool  # NVML loaded and initialised
    reason: str | None = None  # why not (no library, no driver, ...)
    driver: str | None = None
    devices: list[GpuDevice] = field(default_factory=list)


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _err(nv: ModuleType, e: BaseException) -> str:
    name = type(e).__name__
    return f"{name}: {e}" if name not in str(e) else str(e)


def _init(nv: ModuleType) -> None:
    if not any(m is nv for m in _initialised):  # by identity: tests swap in fake modules
        nv.nvmlInit()
        _initialised.append(nv)


def _load() -> tuple[ModuleType | None, str | None]:
    """(module, None) with NVML initialised, or (None, reason)."""
    try:
        nv = _nvml()
    except ImportError as e:
        return None, f"nvidia-ml-py (pynvml) is not installed ({e})"
    try:
        _init(nv)
    except nv.NVMLError as e:
        lib_missing = getattr(nv, "NVMLError_LibraryNotFound", ())
        if lib_missing and isinstance(e, lib_missing):
            return None, "NVML library not found (no NVIDIA driver here)"
        return None, f"NVML did not start ({_err(nv, e)})"
    except OSError as e:
        return None, f"NVML did not start ({e})"
    return nv, None


def _device(nv: ModuleType, index: int, with_processes: bool) -> GpuDevice:
    dev = GpuDevice(index)
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as e:
        dev.errors.append(f"handle: {_err(nv, e)}")
        return dev

    def ask(what: str, fn, *args):
        try:
            return fn(h, *args)
        except nv.NVMLError as e:
            dev.errors.append(f"{what}: {_err(nv, e)}")
            return None

    name = ask("name", nv.nvmlDeviceGetName)
    dev.name = _text(name) if name is not None else "?"
    uuid = ask("uuid", nv.nvmlDeviceGetUUID) if hasattr(nv, "nvmlDeviceGetUUID") else None
    dev.uuid = _text(uuid) if uuid is not None else None
    mem = ask("memory", nv.nvmlDeviceGetMemoryInfo)
    if mem is not None:
        dev.mem_used, dev.mem_total = int(mem.used), int(mem.total)
    util = ask("utilization", nv.nvmlDeviceGetUtilizationRates)
    if util is not None:
        dev.util_percent = int(util.gpu)
    if with_processes:
        procs = ask("processes", nv.nvmlDeviceGetComputeRunningProcesses) or []
        for p in procs:
            pid = int(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            try:
                pname: str | None = _text(nv.nvmlSystemGetProcessName(pid))
            except nv.NVMLError:
                pname = None
            dev.processes.append(GpuProcess(pid, pname, int(used) if isinstance(used, int) else None))
    return dev


def inventory(with_processes: bool = True) -> GpuInventory:
    """Every device with its memory, utilisation and compute processes. Never raises."""
    nv, reason = _load()
    if nv is None:
        return GpuInventory(False, reason)
    inv = GpuInventory(True)
    try:
        inv.driver = _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError:
        inv.driver = None
    try:
        count = int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as e:
        return GpuInventory(True, f"NVML could not count devices ({_err(nv, e)})", inv.driver)
    inv.devices = [_device(nv, i, with_processes) for i in range(count)]
    return inv


def gpu_stats() -> list[dict]:
    """Utilisation and memory per device, for a `gpu_stats` event every few seconds; [] without NVML.

    Each dict: index, name, util_percent, mem_used, mem_total (bytes; None where a query failed).
    """
    inv = inventory(with_processes=False)
    return [{"index": d.index, "name": d.name, "util_percent": d.util_percent, "mem_used": d.mem_used,
             "mem_total": d.mem_total} for d in inv.devices]


class GpuSampler:
    """`poll()` returns `gpu_stats()` once every `interval` seconds (None in between), for the coordinator's
    loop to record as `Event("gpu_stats", detail=detail(devices=stats))`. Without NVML it stops asking."""

    def __init__(self, interval: float = 5.0, clock=None):
        import time  # noqa: PLC0415

        self.interval = interval
        self.clock = clock or time.monotonic
        self.next_at = 0.0
        self.enabled = True

    def poll(self) -> list[dict] | None:
        if not self.enabled:
            return None
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at = now + self.interval
        stats = gpu_stats()
        if not stats:
            self.enabled = False  # no NVML or no GPU: nothing to sample, now or later
            return None
        return stats
