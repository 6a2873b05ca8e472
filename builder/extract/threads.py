"""The threading settings every extraction process gets (kept apart from extract/model.py so that processes
which only start workers can set them without importing torch)."""

from __future__ import annotations

import os

# Run-to-run reproducibility of a CPU forward pass (MKL's and OpenMP's documented conditions): a fixed thread
# count (recorded per run) and no dynamic thread adjustment, which both libraries may otherwise apply per call.
# Workers are spawned with these set, so a sample extracted again later has the same bits.
FIXED_THREADING = {"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


def fix_threading(env: dict[str, str] | None = None) -> None:
    """Set FIXED_THREADING in `env` (default: this process's environment) unless the user set them."""
    target = os.environ if env is None else env
    for key, value in FIXED_THREADING.items():
        target.setdefault(key, value)
