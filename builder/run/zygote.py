"""Imported once, in the fork server that workers are forked from (builder/run/worker_start.py), and nowhere
else: the libraries every worker needs, so that a forked worker starts without importing them. Nothing of
hsbuild's that reads a setting is imported here (a forked child would inherit the value the server read), and
nothing touches a GPU.

The server dies with the process that started it (PR_SET_PDEATHSIG, set before the imports): a coordinator that
exits or is killed while the server still imports does not leave it importing for nothing, and the workers
forked from it die with it (their own parent-death signal). Its liveness pipe (multiprocessing's) stays the
guarantee where that signal does not come (the coordinator died before it was set).
"""

from __future__ import annotations

import os
import signal

from builder.run.prctl import die_with_parent

SERVER_PID = os.getpid()  # a forked worker's expected parent
die_with_parent(signal.SIGKILL)

import numcodecs  # noqa: E402, F401
import numpy  # noqa: E402, F401
import torch  # noqa: E402, F401
import zarr  # noqa: E402, F401
