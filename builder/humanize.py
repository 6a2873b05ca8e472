"""Numbers for people: sizes, percentages, durations."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def pct(x: float) -> str:
    """A fraction as a percentage, with a decimal only where one is needed (0.9 -> 90%, 0.998 -> 99.8%)."""
    return f"{x:.0%}" if round(x * 100, 6).is_integer() else f"{x:.1%}"


def human_seconds(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "?"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"
