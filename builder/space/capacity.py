"""Capacity planning shown by `init`, `status` and `run`: projected final size, free space, will it fit."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from builder.config import BuildConfig, load_config
from builder.humanize import human_bytes, pct
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log
from builder.space.watermarks import SpaceMonitor


def project(log: EventLog, mon: SpaceMonitor, meta: dict | None = None, progress: dict | None = None) -> dict:
    """Projected size of the samples not yet done (measured bytes/token once samples are written, else the
    uncompressed estimate), against the room below the high watermark. `progress` (the `progress` view's row,
    which carries the figures this needs) saves a second pass over the fold when the caller has it."""
    meta = meta if meta is not None else log.meta()
    return project_from(progress if progress is not None else log.progress(), mon, meta)


def project_from(progress: dict, mon: SpaceMonitor, meta: dict) -> dict:
    """`project` given the `progress` view's row: done bytes on disk and tokens, and the samples still to
    extract (failed ones included, retired ones not) with their tokens as they will be stored."""
    done_bytes, done_tokens = progress["disk_bytes_done"], progress["tokens_done"]
    p = mon.projection(int(progress["todo_tokens"] or 0), meta, _per_token(done_bytes, done_tokens),
                       int(progress["todo_samples"] or 0))
    p["final_bytes"] = int((done_bytes or 0) + p["projected_bytes"])
    return p


def stored_tokens(samples: Iterable, max_tokens: int | None, allowance: int | None = None) -> int:
    """The tokens the workers will store of these samples (anything with `num_tokens`): each cut to
    `max_tokens`, as `project` counts them, so `init`, `status` and a run's preflight project the same size.
    A regenerating build's (`allowance`, `response_allowance`): each its first prompt and the allowance, no more
    than `max_tokens` a sample (which bounds prompt and response there), as the `progress` view counts them."""
    samples = list(samples)
    prompts = sum(min(s.num_tokens, max_tokens) if max_tokens else s.num_tokens for s in samples)
    if allowance is None:
        return prompts
    expected = prompts + len(samples) * allowance
    return min(expected, len(samples) * max_tokens) if max_tokens else expected


def response_allowance(log: EventLog, meta: dict) -> int | None:
    """A regenerating build's tokens per sample not yet generated beyond its first prompt (None: not such a
    build): max_new_tokens, or the mean its written samples grew by beyond their first prompts where that is larger
    (with --turns all, the later turns of a conversation). The `progress` view's `response_allowance`."""
    fmt = meta.get("format") if isinstance(meta.get("format"), dict) else {}
    if not fmt.get("regenerate") or not fmt.get("max_new_tokens"):
        return None
    grown, n = log.query("SELECT sum(num_tokens - source_tokens), count(*) FROM samples WHERE state IN "
                         "('written', 'verified') AND finish_reason IS NOT NULL")[1][0]
    return math.ceil(max(int(fmt["max_new_tokens"]), grown / n if n else 0))


def measured_bytes_per_token(log: EventLog) -> float | None:
    """Bytes on disk per token of the live samples (allocated blocks of their shard files and manifests,
    or their compressed bytes where a sample predates that record); None before the first write."""
    row = log.query("SELECT sum(coalesce(disk_bytes, nbytes)), sum(num_tokens) FROM samples "
                    "WHERE state IN ('written', 'verified')")[1][0]
    return _per_token(*row)


def _per_token(nbytes: int | None, tokens: int | None) -> float | None:
    return nbytes / tokens if nbytes and tokens else None


def capacity_from(lay: BuildLayout, cfg: BuildConfig, progress: dict, meta: dict) -> dict:
    """The one answer to "how much more space will this build need, and does it fit", for a reader (`status`
    with no owner, `doctor` with or without one): the projection of `project_from` (retired samples not
    counted) and the volume's figures, given the build's `progress` row and meta. Reads, writes nothing."""
    mon = SpaceMonitor(lay, cfg)
    return {**project_from(progress, mon, meta), **mon.snapshot()}


def capacity_of(lay: BuildLayout, log: EventLog, progress: dict | None = None) -> dict:
    """Projection and disk figures for a build no process owns, from its open log (and its `progress` row, if
    read already)."""
    prog = progress if progress is not None else log.progress()
    return {**capacity_from(lay, load_config(lay), prog, log.meta()), "paused": False, "pause_reason": None}


def capacity_for(lay: BuildLayout) -> dict:
    """`capacity_of` a build no process owns, opening its log."""
    with open_log(lay.events, read_only=True, wait=5.0) as log:
        prog = log.progress()
        return {**capacity_of(lay, log, prog), "samples": prog["total"], "tokens": prog["tokens_total"],
                "response_allowance": prog.get("response_allowance")}


def describe_capacity(lay: BuildLayout) -> list[str]:
    p = capacity_for(lay)
    fit = "fits" if p["fits"] else "does NOT fit"
    allowance = p.get("response_allowance")
    source = (describe_source(lay, p["samples"], p["tokens"]) if allowance is None else
              [f"source: {p['samples']:,} conversation(s); {p['tokens']:,} token(s) as stored at most: each "
               f"sample's first prompt + {allowance:,} generated (--max-new-tokens; with --turns all the later "
               "turns come on top, counted at their measured mean once samples are written)"])
    return [
        *source,
        f"projected size: {human_bytes(p['final_bytes'])} ({p['basis']}, {p['bytes_per_token']} B/token)",
        f"volume: {human_bytes(p['free_bytes'])} free of {human_bytes(p['total_bytes'])} ({p['usage']:.1%} used); "
        f"the build {fit} below the high watermark ({pct(p['high'])})"
        + ("" if p["fits"] else "; `run` will refuse unless --allow-overcommit"),
    ]


def describe_source(lay: BuildLayout, samples: int, tokens: int) -> list[str]:
    """What `init` says of the source: its size as stored, and what happens to samples longer than a run keeps
    (its `init` event's `long`, builder/run/create.py: cut to --max-tokens, or failed as too long)."""
    with open_log(lay.events, read_only=True, wait=5.0) as log:
        rows = log.query("SELECT detail->'long' FROM events WHERE kind = 'init' ORDER BY seq DESC LIMIT 1")[1]
    long = json.loads(rows[0][0]) if rows and rows[0][0] else None
    if not long:
        return [f"source: {samples:,} sample(s), {tokens:,} token(s)"]
    n, limit, top = long["count"], long["limit"], long["longest"]
    longest = f"the longest: {top['sample_id']}, {top['tokens']:,} tokens"
    if long["then"] == "cut":
        return [f"source: {samples:,} sample(s), {tokens:,} token(s) as stored: {n:,} longer than --max-tokens "
                f"{limit:,} ({longest}) are cut to it (their written events say how many tokens were cut: "
                "`truncated`)"]
    return [f"source: {samples:,} sample(s), {tokens:,} token(s)",
            f"too long: {n:,} sample(s) longer than the model's {limit:,} positions ({longest}) will fail "
            f"(`too_long`): without --max-tokens nothing is cut; to keep them cut to {limit:,} tokens, make the "
            f"build again with --max-tokens {limit} (`hsbuild init --force`), or leave them out with "
            f"`hsbuild skip {lay.root} ID...`"]
