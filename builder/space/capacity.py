"""Capacity planning shown by `init`, `status` and `run`: projected final size, free space, will it fit."""

from __future__ import annotations

from collections.abc import Iterable

from builder.config import BuildConfig, load_config
from builder.humanize import human_bytes, pct
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log
from builder.space.watermarks import SpaceMonitor


def project(log: EventLog, cfg: BuildConfig, mon: SpaceMonitor, meta: dict | None = None) -> dict:
    """Projected size of the samples not yet done (measured bytes/token once samples are written, else the
    uncompressed estimate), against the room below the high watermark."""
    meta = meta if meta is not None else log.meta()
    cap = cfg.max_tokens
    done_bytes, done_tokens, remaining, remaining_samples = log.query(
        "SELECT sum(coalesce(disk_bytes, nbytes)) FILTER (WHERE state IN ('written', 'verified')), "
        "sum(num_tokens) FILTER (WHERE state IN ('written', 'verified')), "
        "sum(CASE WHEN ? IS NULL THEN source_tokens ELSE least(source_tokens, ?) END) "
        "FILTER (WHERE state NOT IN ('written', 'verified')), "
        "count(*) FILTER (WHERE state NOT IN ('written', 'verified')) FROM samples", [cap, cap])[1][0]
    p = mon.projection(int(remaining or 0), meta, _per_token(done_bytes, done_tokens), int(remaining_samples or 0))
    p["final_bytes"] = int((done_bytes or 0) + p["projected_bytes"])
    return p


def stored_tokens(samples: Iterable, max_tokens: int | None) -> int:
    """The tokens the workers will store of these samples (anything with `num_tokens`): each cut to
    `max_tokens`, as `project` counts them, so `init`, `status` and a run's preflight project the same size."""
    return sum(min(s.num_tokens, max_tokens) if max_tokens else s.num_tokens for s in samples)


def measured_bytes_per_token(log: EventLog) -> float | None:
    """Bytes on disk per token of the live samples (allocated blocks of their shard files and manifests,
    or their compressed bytes where a sample predates that record); None before the first write."""
    row = log.query("SELECT sum(coalesce(disk_bytes, nbytes)), sum(num_tokens) FROM samples "
                    "WHERE state IN ('written', 'verified')")[1][0]
    return _per_token(*row)


def _per_token(nbytes: int | None, tokens: int | None) -> float | None:
    return nbytes / tokens if nbytes and tokens else None


def capacity_for(lay: BuildLayout) -> dict:
    """Projection and disk figures for a build no process owns."""
    cfg = load_config(lay)
    mon = SpaceMonitor(lay, cfg)
    with open_log(lay.events, read_only=True, wait=5.0) as log:
        p = project(log, cfg, mon)
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
