"""Linux process controls (prctl) that hsbuild's processes set on themselves: the signal a process gets when its
parent dies, and the name ps and top show. Best effort (no libc, another OS: nothing). Standard library only,
so the fork server (builder/run/zygote.py) and a child between fork and exec can call it.
"""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(sig: int) -> None:
    """This process gets `sig` when the thread that started it exits."""
    _prctl(PR_SET_PDEATHSIG, sig)


def set_process_name(name: str) -> None:
    """Name this process (15 bytes at most) as ps and top show it."""
    _prctl(PR_SET_NAME, name.encode()[:15])
