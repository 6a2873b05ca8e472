"""Capacity planning shown by `init`, `status` and `run`: projected final size, free space, will it fit."""

from __future__ import annotations

from .build import load_config
from .events import open_log
from .layout import BuildLayout
from .progress import human_bytes, pct
from .watermarks import SpaceMonitor


def capacity_for(lay: BuildLayout, progress: dict | None = None) -> dict:
    """Projection for the samples not yet done, from measured bytes/token when there are any."""
    cfg = load_config(lay)
    with open_log(lay.events, read_only=True, wait=5.0) as log:
        meta = log.meta()
        prog = progress or log.progress()
        row = log.query("SELECT sum(nbytes), sum(num_tokens), "
                        "sum(source_tokens) FILTER (WHERE state NOT IN ('written', 'verified')) FROM samples")[1][0]
    measured = row[0] / row[1] if row[0] and row[1] else None
    remaining = int(row[2] or 0)
    if cfg.max_tokens:
        remaining = min(remaining, int(prog.get("remaining", 0)) * cfg.max_tokens) if prog else remaining
    mon = SpaceMonitor(lay, cfg)
    p = mon.projection(remaining, meta, measured)
    p["final_bytes"] = int((row[0] or 0) + p["projected_bytes"])
    return {**p, **mon.snapshot(), "paused": False, "pause_reason": None}


def describe_capacity(lay: BuildLayout) -> list[str]:
    p = capacity_for(lay)
    fit = "fits" if p["fits"] else "does NOT fit"
    return [
        f"projected size: {human_bytes(p['final_bytes'])} ({p['basis']}, {p['bytes_per_token']} B/token)",
        f"volume: {human_bytes(p['free_bytes'])} free of {human_bytes(p['total_bytes'])} ({p['usage']:.1%} used); "
        f"the build {fit} below the high watermark ({pct(p['high'])})"
        + ("" if p["fits"] else "; `run` will refuse unless --allow-overcommit"),
    ]
