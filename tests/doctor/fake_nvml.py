"""A fake of the few pynvml calls `builder.doctor.gpu` makes, substituted at `builder.doctor.gpu._nvml`.

There is no GPU on the development machines or in CI, so GPU scenarios (eight GPUs held by a vLLM service,
a device that errors on query) are played by this module. The PIDs it reports are real live processes the
test spawns, so /proc (command line, parent chain) is real; only the cgroup text is a fixture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

GiB = 1 << 30
H100_TOTAL = 81559 << 20  # what NVML reports for an H100 80GB HBM3


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
    def __str__(self) -> str:
        return "NVML Shared Library Not Found"


class NVMLError_Unknown(NVMLError):  # noqa: N801 - pynvml's name
    def __str__(self) -> str:
        return "Unknown Error"


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = H100_TOTAL
    used: int = 512 << 20
    util: int = 0
    procs: list[tuple[int, int | None, str]] = field(default_factory=list)  # (pid, used bytes, NVML name)
    fail: set[str] = field(default_factory=set)  # queries that raise NVMLError: memory, utilization, processes
    # queries that raise something else, as a pynvml built for another driver does (its process struct does not
    # match the driver's: a TypeError out of ctypes, no NVMLError): a check that crashes
    crash: set[str] = field(default_factory=set)


class FakeNVML:
    """Module-like: `monkeypatch.setattr(builder.doctor.gpu, "_nvml", lambda: FakeNVML(gpus))`."""

    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    def __init__(self, gpus: list[FakeGpu] | None = None, library_missing: bool = False, driver: str = "550.54.15"):
        self.gpus = gpus or []
        self.library_missing = library_missing
        self.driver = driver
        self.init_calls = 0

    def nvmlInit(self) -> None:  # noqa: N802
        self.init_calls += 1
        if self.library_missing:
            raise NVMLError_LibraryNotFound()

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return self.driver

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:  # noqa: N802
        return self.gpus[i]

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:  # noqa: N802
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:  # noqa: N802
        return f"GPU-{self.gpus.index(h):08d}-fake"

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> SimpleNamespace:  # noqa: N802
        if "memory" in h.fail:
            raise NVMLError_Unknown()
        return SimpleNamespace(total=h.total, used=h.used, free=h.total - h.used)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> SimpleNamespace:  # noqa: N802
        if "utilization" in h.fail:
            raise NVMLError_Unknown()
        return SimpleNamespace(gpu=h.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[SimpleNamespace]:  # noqa: N802
        if "processes" in h.fail:
            raise NVMLError_Unknown()
        if "processes" in h.crash:
            raise TypeError("c_nvmlProcessInfo_v3_t: expected 4 fields, the driver returned 3")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used, _ in h.procs]

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:  # noqa: N802
        for g in self.gpus:
            for p, _, name in g.procs:
                if p == pid:
                    return name.encode()
        raise NVMLError_Unknown()


def seed_gpus(pids: list[int], used: int = int(75.8 * GiB)) -> list[FakeGpu]:
    """The seed's situation: each of 8 GPUs held by one process of a vLLM service, 75.8 GiB each."""
    return [FakeGpu(used=used + (300 << 20), util=0, procs=[(pid, used, "/usr/bin/python3")]) for pid in pids]


def unit_cgroup(unit: str) -> str:
    """/proc/PID/cgroup of a process in a system service (cgroup v2 with the v1 name=systemd line)."""
    return f"1:name=systemd:/system.slice/{unit}\n0::/system.slice/{unit}\n"
