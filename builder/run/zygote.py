"""Imported once, in the fork server that workers are forked from (builder/run/worker_start.py): the libraries
every worker needs, so that a forked worker starts without importing them. Nothing of hsbuild's that reads a
setting is imported here (a forked child would inherit the value the server read), and nothing touches a GPU.
"""

from __future__ import annotations

import os

SERVER_PID = os.getpid()  # a forked worker's expected parent

import numcodecs  # noqa: E402, F401
import numpy  # noqa: E402, F401
import torch  # noqa: E402, F401
import zarr  # noqa: E402, F401
