"""Render `hsbuild doctor` for the seed's situation, for docs/doctor.md.

After a reboot, a systemd service `vllm-kimi-k25-int4.service` held all 8 GPUs at 75.8 GiB each. This
machine has no GPU, so NVML is the fake from tests/doctor/fake_nvml.py (8 x H100 80GB); the eight holders are real
live stand-in processes (`/usr/bin/python3 DIR/bin/vllm serve ...`, not our descendants), and their
/proc/PID/cgroup is a fixture naming the unit. Storage, the build and its event log are real.

    .venv/bin/python tools/doctor_seed_example.py [DIR]      # DIR defaults to a new temp directory
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "doctor")]

from fake_nvml import FakeNVML, seed_gpus, unit_cgroup  # noqa: E402

from builder.config import load_config  # noqa: E402
from builder.doctor import checks as doctor_checks  # noqa: E402
from builder.doctor import gpu  # noqa: E402
from builder.doctor.report import preflight_for_run, render_lines, run_doctor  # noqa: E402
from builder.errors import PreflightError  # noqa: E402
from builder.extract.demo import write_demo_source  # noqa: E402
from builder.layout import layout  # noqa: E402
from builder.log.events import EventLog  # noqa: E402
from builder.run.create import init_build  # noqa: E402

UNIT = "vllm-kimi-k25-int4.service"
SERVE = ["serve", "/models/Kimi-K2.5-int4", "--tensor-parallel-size", "8", "--port", "8000"]


def start_standins(bindir: Path, n: int = 8) -> list[int]:
    """n processes that look like `vllm serve` and are not our descendants (their parent exits at once)."""
    bindir.mkdir(parents=True, exist_ok=True)
    exe = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    script = bindir / "vllm"
    script.write_text(f"#!{exe}\nimport time\ntime.sleep(600)\n")
    script.chmod(0o755)
    pids = []
    for _ in range(n):
        out = subprocess.run(["sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", str(script), *SERVE],
                             capture_output=True, text=True, check=True).stdout
        pids.append(int(out))
    return pids


def main(argv: list[str]) -> int:
    base = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="hsbuild-doctor-example-"))
    build = base / "kimi-k25-eagle3"
    if build.exists():
        shutil.rmtree(build)
    base.mkdir(parents=True, exist_ok=True)
    src = write_demo_source(base / "source.jsonl", n=200)
    lay = init_build(build, src, model="builtin", device="cuda")
    pids = start_standins(base / "bin")
    try:
        nvml = FakeNVML(seed_gpus(pids))
        gpu._nvml = lambda: nvml  # type: ignore[assignment]
        doctor_checks.cuda_probe = lambda: (True, 8, "torch 2.5.1 (CUDA 12.4)")  # type: ignore[assignment]
        units = set(pids)

        def cgroup(pid: int) -> str | None:
            return unit_cgroup(UNIT) if pid in units else None

        report = run_doctor(layout(build), cgroup_reader=cgroup)
        print(f"$ hsbuild doctor {build}")
        print("\n".join(render_lines(report)))
        print(f"\n$ hsbuild run {build}")
        with EventLog(lay.events) as log:
            try:
                preflight_for_run(lay, load_config(lay), log, force=False, own_pids={os.getpid()},
                                  cgroup_reader=cgroup)
            except PreflightError as e:
                print(f"hsbuild run: error: {e}")
                print(f"(exit code {e.exit_code})")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
