"""Every figure's series, from the event log alone (`collect`): what `hsbuild report --json` prints and the page
draws. Read through `builder.log.query.run_query`: a live build is asked of its owner (as `status` and `sql` are),
an idle one is opened read-only; nothing is written."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable

from builder.layout import BuildLayout
from builder.log.lock import inspect_lock
from builder.log.query import run_queries
from builder.report import queries as Q

MAX_BUCKETS = 240  # points on a time axis: a laptop screen's width of bars
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)
STATES = ("pending", "started", "written", "verified", "failed", "retired")
LENGTH_BINS = 40
QUERY_TIMEOUT_S = 600.0

Ask = Callable[[list[str]], list[tuple[list[str], list[list]]]]  # SELECTs -> each one's (columns, rows)


def bucket_width(span: float) -> float:
    """The smallest round width (seconds) that puts `span` in at most MAX_BUCKETS buckets."""
    need = span / MAX_BUCKETS
    for step in STEPS:
        if step >= need:
            return float(step)
    return float(math.ceil(need / STEPS[-1]) * STEPS[-1])


# the figures drawn from the light series alone (`collect`'s `on_light`), while the heavy ones are still asked
EARLY_FIGURES = ("throughput", "failures", "disk", "workers")


def collect(lay: BuildLayout, run: Ask | None = None, timeout: float = QUERY_TIMEOUT_S,
            on_light: Callable[[dict], None] | None = None) -> dict:
    """Every series of the report, JSON-able. `run`: how SELECTs are asked (default: `run_queries` over the build:
    through its live owner if any, else from read-only opens of the log). The time axis first; then the two
    statements that read every sample event or fold every sample (the states over time, the counts now) are asked
    in a thread while the others are, and `on_light(series)`, if given, is called with the series of
    EARLY_FIGURES complete (so the page draws those meanwhile: DuckDB gives up the GIL while it queries)."""
    run = run or (lambda sqls: run_queries(lay, sqls, timeout=timeout))

    def dicts(res: tuple[list[str], list[list]]) -> list[dict]:
        cols, rows = res
        return [dict(zip(cols, r, strict=True)) for r in rows]

    lock = inspect_lock(lay)
    live = (lock.info or {}) if lock.held else {}
    span = dicts(run([Q.SPAN])[0])[0]
    t0, t1 = float(span["t0"] or 0.0), float(span["t1"] or 0.0)
    w = bucket_width(t1 - t0)
    nb = int((t1 - t0) // w) + 1
    fmt = {"t0": repr(t0), "w": repr(w)}
    # the last bucket ends at the log's last event: its rates are over the part of it the log covers (at least
    # 1 s), not its whole width (during a run that would show every report's last point falling)
    last = min(w, max(t1 - (t0 + (nb - 1) * w), 1.0))
    axis = {"t0": t0, "t1": t1, "bucket_s": w, "buckets": nb, "last_bucket_s": last,
            "t": [t0 + i * w for i in range(nb)]}
    heavy = {"moves": Q.MOVES.format(**fmt), "now": Q.NOW}
    if live:  # the recent rate, while a run extracts
        heavy["recent"] = Q.RECENT
    asked: dict = {}

    def ask_heavy() -> None:
        try:
            asked["got"] = dict(zip(heavy, (dicts(r) for r in run(list(heavy.values()))), strict=True))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            asked["error"] = e

    worker = threading.Thread(target=ask_heavy, name="hsbuild-report-series", daemon=True)
    worker.start()
    try:
        light = {"meta": Q.META, "config": Q.LAST_CONFIG, "runs": Q.RUNS, "marks": Q.MARKS,
                 "written": Q.WRITTEN.format(**fmt), "failed": Q.FAILED.format(**fmt), "workers": Q.WORKERS,
                 "nodes": Q.NODES}
        got = dict(zip(light, (dicts(r) for r in run(list(light.values()))), strict=True))
        meta = {r["key"]: _json(r["value"]) for r in got["meta"]}
        config = (got["config"] or [{}])[0]
        runs, marks = got["runs"], got["marks"]
        build = {"path": str(lay.root), "model": meta.get("model"), "model_fingerprint": meta.get("model_fingerprint"),
                 "format": meta.get("format"), "created_at": meta.get("created_at"), "source": meta.get("source"),
                 "config": next(iter(config.values()), None), "events": span["n"],
                 "live": {"running": bool(live), "run_id": live.get("run_id"), "purpose": live.get("purpose"),
                          "pid": live.get("pid")}}
        throughput = _throughput(got["written"], [w] * (nb - 1) + [last])
        early = {"build": build, "axis": axis, "runs": runs, "throughput": throughput,
                 "events_marked": _marks(marks, runs, live.get("run_id"), t1), "rebuilt": _rebuilt(marks),
                 "failures": _failures(got["failed"], [], nb), "disk": _disk(throughput["disk_bytes"], marks),
                 "workers": _workers(got["workers"], runs), "nodes": got["nodes"]}
        if on_light is not None:
            on_light(early)
    finally:
        worker.join()
    if "error" in asked:
        raise asked["error"]
    more = asked["got"]
    cur = more["now"][0]
    early["failures"]["most"] = cur["failed_most"] or []
    states = _states(more["moves"], cur["registered"], nb)
    now = _now(cur["counts"], t1)
    if live:
        now["recent_samples_per_s"] = more["recent"][0]["recent_samples_per_s"]
    fmt_meta = meta.get("format")
    if isinstance(fmt_meta, dict) and fmt_meta.get("regenerate"):
        # a regenerating build's expected tokens count each response not yet generated as the `progress` view's
        # allowance (docs/regenerate.md, "Tokens and space"): that view's rule, asked of it, not repeated here
        prog = dicts(run([Q.PROGRESS_TOKENS])[0])[0]
        now.update(prog)
    out = {k: early[k] for k in ("build", "axis", "runs", "throughput", "events_marked", "rebuilt")}
    out["states"] = states
    out["now"] = now
    out["eta"] = _eta(now, runs, bool(live))
    out["lengths"] = _lengths(cur["lengths"] or [])
    out["generated"] = _generated(cur["generated"] or [], cur["dropped_at_limit"])
    out["failures"] = early["failures"]
    out["disk"] = early["disk"]
    out["verification"] = _verification(states, cur["ages"] or [], runs, now)
    out["workers"] = early["workers"]
    out["nodes"] = early["nodes"]
    return out


def _json(v: object) -> object:
    try:
        return json.loads(v) if isinstance(v, str) else v
    except ValueError:
        return v


def _dense(rows: list[dict], nb: int, key: str) -> list:
    out = [0] * nb
    for r in rows:
        if 0 <= r["b"] < nb:
            out[r["b"]] += r[key]
    return out


def _throughput(rows: list[dict], widths: list[float]) -> dict:
    """What each bucket wrote, and its rates over each bucket's seconds (`widths`)."""
    nb = len(widths)
    samples, tokens = _dense(rows, nb, "samples"), _dense(rows, nb, "tokens")
    nbytes, disk = _dense(rows, nb, "nbytes"), _dense(rows, nb, "disk_bytes")
    return {"samples": samples, "tokens": tokens, "nbytes": nbytes, "disk_bytes": disk,
            "restored": _dense(rows, nb, "restored"), "adopted": _dense(rows, nb, "adopted"),
            "samples_per_s": [n / w for n, w in zip(samples, widths, strict=True)],
            "mb_per_s": [b / 1e6 / w for b, w in zip(nbytes, widths, strict=True)],
            "tokens_per_s": [t / w for t, w in zip(tokens, widths, strict=True)]}


PAUSE_ENGINE = {"server_unavailable", "staging_full"}


def _marks(marks: list[dict], runs: list[dict], live_run: str | None, t_end: float) -> dict:
    """Points (runs started and ended, killed, engine checks, lost workers, the log's history) and spans (pauses
    for space or for the engine, storage stalls) on the time axis."""
    points, spans, open_pauses = [], [], {}
    for m in marks:
        kind, t, reason, detail = m["kind"], m["t"], m["reason"], _json(m["detail"]) or {}
        if kind == "paused":
            open_pauses[(m["run_id"], reason)] = m
        elif kind == "resumed" and (m["run_id"], reason) in open_pauses:
            p = open_pauses.pop((m["run_id"], reason))
            spans.append(_pause(p, t))
        elif kind == "unstalled" and isinstance(detail, dict) and detail.get("since") is not None:
            spans.append({"kind": "stall", "a": detail["since"], "b": detail["since"] + (detail.get("duration_s") or 0),
                          "reason": detail.get("what"), "run_id": m["run_id"]})
        elif kind in ("run_started", "verify_started"):
            points.append({"t": t, "kind": kind, "run_id": m["run_id"], "label": "run" if kind == "run_started" else "verify"})
        elif kind in ("run_finished", "verify_finished"):
            bad = reason not in ("completed", "damage_found", "check_errors", "continued")
            points.append({"t": t, "kind": "interrupted" if bad else kind, "run_id": m["run_id"], "reason": reason,
                           "label": reason})
        elif kind in ("engine_probe", "engine_refused", "worker_lost", "gc", "log_rebuilt", "source_changed",
                      "adopted", "init"):
            points.append({"t": t, "kind": kind, "run_id": m["run_id"], "reason": reason, "label": kind})
    for (run_id, _reason), p in open_pauses.items():  # a pause that never ended: to its run's end (or now)
        end = next((r["finished_at"] or r["last_at"] for r in runs if r["run_id"] == run_id), None)
        spans.append(_pause(p, end if end is not None and run_id != live_run else t_end, ended=False))
    for r in runs:  # a run with no end record and no live owner was killed (kill -9, a crash) after its last event
        if r["outcome"] == "unfinished" and r["run_id"] != live_run:
            points.append({"t": r["last_at"], "kind": "killed", "run_id": r["run_id"], "label": "killed",
                           "reason": "no end record"})
    points.sort(key=lambda p: p["t"])
    return {"points": points, "spans": sorted(spans, key=lambda s: s["a"])}


def _rebuilt(marks: list[dict]) -> list[dict]:
    """Each `hsbuild rebuild-log` of this log: when, and what it restored (its `log_rebuilt` event's counts). The
    history before it is what the rebuild could restore, every event of it at the rebuild's time."""
    out = []
    for m in marks:
        if m["kind"] == "log_rebuilt":
            d = _json(m["detail"])
            d = d if isinstance(d, dict) else {}
            out.append({"t": m["t"], **{k: d.get(k) for k in ("written", "verified", "skipped", "failed",
                                                                "read_back", "segments")}})
    return out


def _pause(p: dict, end: float, ended: bool = True) -> dict:
    detail = _json(p["detail"]) or {}
    return {"kind": "engine" if p["reason"] in PAUSE_ENGINE else "pause", "a": p["t"], "b": end, "reason": p["reason"],
            "run_id": p["run_id"], "ended": ended, "usage": detail.get("usage") if isinstance(detail, dict) else None}


def _states(moves: list[dict], registered: int, nb: int) -> dict:
    """Samples in each state at the end of each bucket (every registered sample starts pending)."""
    delta = {s: [0] * nb for s in STATES}
    for m in moves:
        if 0 <= m["b"] < nb:
            delta[m["prev"]][m["b"]] -= m["n"]
            delta[m["st"]][m["b"]] += m["n"]
    out = {}
    for s in STATES:
        acc, level = [], registered if s == "pending" else 0
        for d in delta[s]:
            level += d
            acc.append(level)
        out[s] = acc
    return out


def _now(counts: dict, last_event_at: float) -> dict:
    """The counts now, as the `progress` view (and `status`) gives them."""
    now = dict(counts)
    now["done"] = now["written"] + now["verified"]
    now["remaining"] = now["total"] - now["done"] - now["failed"]
    now["last_event_at"] = last_event_at
    now["recent_samples_per_s"] = None
    return now


def _eta(now: dict, runs: list[dict], live: bool) -> dict:
    """The time left: at the recent rate while a run extracts, else at the last extraction run's rate."""
    remaining = now.get("remaining") or 0
    if live and now.get("recent_samples_per_s"):
        rate = now["recent_samples_per_s"]
        return {"remaining": remaining, "samples_per_s": rate, "basis": "recent (last minute)",
                "seconds": remaining / rate}
    last = next((r for r in reversed(runs) if r["kind"] == "extract" and r.get("samples_per_s")), None)
    if last is None:
        return {"remaining": remaining, "samples_per_s": None, "basis": "no run has written yet", "seconds": None}
    return {"remaining": remaining, "samples_per_s": last["samples_per_s"],
            "basis": f"run {last['run_id'][:8]}'s rate", "seconds": remaining / last["samples_per_s"]}


def _lengths(rows: list[dict]) -> dict:
    n = sum(r["n"] for r in rows)
    if not n:
        return {"samples": 0, "tokens": 0, "edges": [], "counts": []}
    lo, hi = rows[0]["num_tokens"], rows[-1]["num_tokens"]
    width = max(1, math.ceil((hi - lo + 1) / LENGTH_BINS))
    edges = [lo + i * width for i in range(math.ceil((hi - lo + 1) / width) + 1)]
    counts = [0] * (len(edges) - 1)
    for r in rows:
        counts[(r["num_tokens"] - lo) // width] += r["n"]
    tokens = sum(r["num_tokens"] * r["n"] for r in rows)
    return {"samples": n, "tokens": tokens, "mean": tokens / n, "median": _quantile(rows, n, 0.5),
            "p99": _quantile(rows, n, 0.99), "min": lo, "max": hi, "edges": edges, "counts": counts}


def _quantile(rows: list[dict], n: int, q: float) -> int:
    """The smallest length with at least q of the samples at or below it."""
    acc = 0
    for r in rows:
        acc += r["n"]
        if acc >= q * n:
            return r["num_tokens"]
    return rows[-1]["num_tokens"]


def _generated(rows: list[dict], dropped: int) -> dict | None:
    """A regenerating build: generated tokens per stored response, and the share that stopped at the token limit
    (finish_reason 'length') rather than at a stop token; None where no sample says (not a regenerating build)."""
    if not rows:
        return None
    hist = _lengths(_merge([{"num_tokens": r["generated"], "n": r["n"]} for r in rows if r["generated"] is not None]))
    n = sum(r["n"] for r in rows)
    at_limit = sum(r["n"] for r in rows if r["finish_reason"] == "length")
    return {"samples": n, "at_token_limit": at_limit, "truncated_share": at_limit / n if n else None,
            "dropped_at_token_limit": dropped, "histogram": hist}


def _merge(rows: list[dict]) -> list[dict]:
    acc: dict[int, int] = {}
    for r in rows:
        acc[r["num_tokens"]] = acc.get(r["num_tokens"], 0) + r["n"]
    return [{"num_tokens": k, "n": v} for k, v in sorted(acc.items())]


def _failures(rows: list[dict], most: list[dict], nb: int) -> dict:
    reasons: dict[str, list[int]] = {}
    transient = set()
    for r in rows:
        reason = r["reason"] or "unknown"
        reasons.setdefault(reason, [0] * nb)
        if 0 <= r["b"] < nb:
            reasons[reason][r["b"]] += r["n"]
        if r["transient"]:
            transient.add(reason)
    totals = {k: sum(v) for k, v in reasons.items()}
    return {"by_reason": reasons, "totals": totals, "transient": sorted(transient), "most": most}


def _disk(disk_bytes: list[int], marks: list[dict]) -> dict:
    """Bytes written over time (cumulative, each sample's share of its group's blocks), and the volume's free
    space and watermarks where the log recorded them (the pause and resume events carry the figures)."""
    acc, level = [], 0
    for b in disk_bytes:
        level += b
        acc.append(level)
    free = []
    for m in marks:
        d = _json(m["detail"]) or {}
        if m["kind"] in ("paused", "resumed") and isinstance(d, dict) and d.get("usage") is not None:
            free.append({"t": m["t"], "kind": m["kind"], "reason": m["reason"], "usage": d["usage"],
                         "free_bytes": d.get("free_bytes"), "total_bytes": d.get("total_bytes"),
                         "low": d.get("low"), "high": d.get("high"), "flood": d.get("flood")})
    return {"written_bytes": acc, "volume": free}


def _verification(states: dict, ages: list[dict], runs: list[dict], now: dict) -> dict:
    share = [(v / (w + v)) if (w + v) else None for w, v in zip(states["written"], states["verified"], strict=True)]
    live = now["written"] + now["verified"]
    by_age = {b: 0 for b in Q.AGE_BINS}
    for r in ages:
        by_age[r["bin"]] = r["n"]
    sweeps = [r for r in runs if r["kind"] == "verify"]
    last = sweeps[-1] if sweeps else None
    return {"share": share, "share_now": now["verified"] / live if live else None, "by_age": by_age,
            "age_measured_from": now["last_event_at"], "sweeps": len(sweeps),
            "last_sweep": None if last is None else {k: last[k] for k in ("run_id", "started_at", "finished_at",
                                                                          "outcome", "verified", "failed")}}


def _workers(rows: list[dict], runs: list[dict]) -> list[dict]:
    """Per worker of each run: what it wrote, and its rate over its run's time spent extracting."""
    active = {r["run_id"]: r["active_s"] for r in runs}
    out = []
    for r in rows:
        a = active.get(r["run_id"])
        out.append({**r, "samples_per_s": r["written"] / a if a else None,
                    "mb_per_s": r["nbytes"] / 1e6 / a if a else None})
    return out
