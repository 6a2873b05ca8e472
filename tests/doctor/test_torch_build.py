"""The run's preflight learns whether torch can use CUDA without importing torch where the answer is plain from
torch's build description (a CPU-only build): importing it cost every `hsbuild run` more than a second."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from builder.doctor.checks import cuda_probe, torch_build


def test_the_build_description_read_from_the_file_is_torchs_own() -> None:
    b = torch_build()
    assert b is not None
    assert b["__version__"] == torch.__version__
    assert b["cuda"] == torch.version.cuda and b["hip"] == torch.version.hip


def test_a_cuda_build_is_told_apart(tmp_path) -> None:
    f = tmp_path / "version.py"
    f.write_text("from typing import Optional\n__version__ = '2.9.1+cu128'\ncuda: Optional[str] = '12.8'\n"
                 "hip: Optional[str] = None\n")
    assert torch_build(f) == {"__version__": "2.9.1+cu128", "cuda": "12.8", "hip": None}
    f.write_text("this is not python(")
    assert torch_build(f) is None
    assert torch_build(tmp_path / "missing.py") is None


@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="a CUDA/ROCm build of torch: the probe must import torch to ask the driver")
def test_on_a_cpu_only_build_the_probe_does_not_import_torch() -> None:
    code = ("import sys; from builder.doctor.checks import cuda_probe; r = cuda_probe(); "
            "print(r[0], r[1], 'torch' in sys.modules)")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.stdout.split() == ["False", "0", "False"], cp.stderr
    assert cuda_probe()[2] == f"torch {torch.__version__} (CPU-only build)"
