"""Preflight checks: GPUs (and who squats on them), storage, build state, environment."""
