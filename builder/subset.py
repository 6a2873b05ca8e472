"""`--subset n/t`: a build's samples in t fixed parts by id, the same part for a sample on every machine and every
run, so that t commands (verify sweeps, exports) over 1/t .. t/t cover every sample exactly once."""

from __future__ import annotations

import hashlib

from builder.errors import UsageError


def parse_subset(s: str) -> tuple[int, int]:
    n_s, sep, t_s = str(s).partition("/")
    try:
        n, t = int(n_s), int(t_s)
    except ValueError:
        n = t = 0
    if not sep or not 1 <= n <= t:
        raise UsageError(f"--subset '{s}': give n/t with 1 <= n <= t, e.g. 1/3 (t sweeps 1/t .. t/t cover all)")
    return n, t


def stable_part(sample_id: str, parts: int) -> int:
    """0-based part of a sample among `parts`, the same on every machine and every run."""
    h = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % parts
