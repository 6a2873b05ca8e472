"""Run a command and say how busy it kept the whole machine: wall time, and CPU seconds of every process
(Linux `/proc/stat`, read before and after), not only those the command reaps.

`/usr/bin/time` counts the command and the children it waits for. It misses processes that others reap or that
outlive their parent: vLLM's engine processes, Ray's daemons, the kernel's work for them. For the test suite it
said 128% of 2 cores while the machine was 88% busy. Run it on an otherwise idle machine:

    python tools/machine_busy.py -- .venv/bin/python -m pytest -q

Prints one line to stderr after the command's own output, and exits with the command's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python tools/machine_busy.py -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    hz = os.sysconf("SC_CLK_TCK")
    busy0, total0 = _jiffies()
    t0 = time.monotonic()
    rc = subprocess.call(argv)
    wall = time.monotonic() - t0
    busy1, total1 = _jiffies()
    busy, total = (busy1 - busy0) / hz, (total1 - total0) / hz
    cores = os.cpu_count() or 1
    print(f"machine_busy: wall {wall:.1f} s; all processes {busy:.1f} CPU-s = {100 * busy / max(total, 1e-9):.1f}% "
          f"of {cores} core(s); exit {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
