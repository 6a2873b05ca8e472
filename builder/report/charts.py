"""The report's figures, drawn with matplotlib (the `report` extra) as SVG text to inline in the page: no file, no
network at view time. Each figure is drawn from `series.collect`'s series only (what --json prints)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import io
import re
import threading
from typing import Any

from builder.errors import UsageError
from builder.humanize import human_bytes

FIGURES = ("throughput", "states", "lengths", "failures", "disk", "verification", "workers")  # the page's order
WIDTH_IN = 11.0  # a laptop screen's width at the page's 96 dpi

COLORS = {"pending": "#bbbbbb", "started": "#f2c14e", "written": "#4c78a8", "verified": "#54a24b",
          "failed": "#e45756", "retired": "#9d755d"}
SPAN_COLORS = {"pause": "#f58518", "engine": "#b279a2", "stall": "#e45756"}
POINT_STYLE = {"run_started": ("#54a24b", "--"), "verify_started": ("#72b7b2", "--"), "run_finished": ("#54a24b", ":"),
               "verify_finished": ("#72b7b2", ":"), "interrupted": ("#e45756", "-"), "killed": ("#e45756", "-"),
               "engine_probe": ("#b279a2", ":"), "engine_refused": ("#b279a2", "-"), "worker_lost": ("#e45756", ":"),
               "log_rebuilt": ("#000000", "-."), "adopted": ("#9d755d", ":"), "gc": ("#888888", ":"),
               "source_changed": ("#888888", "-."), "init": ("#888888", ":")}


MISSING = "hsbuild report draws its charts with matplotlib, which is not installed: pip install 'hsbuild[report]'"


def check_matplotlib() -> None:
    """Refuse in one line, before anything is read, where matplotlib is not installed (found, not imported)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(MISSING)


def preload_matplotlib() -> threading.Thread:
    """Import what drawing needs in a thread (about 0.5 s of CPU), while the log is read (DuckDB gives up the GIL
    while it queries): `draw_all`'s imports then find the modules loaded, or wait for them. A failure here is
    left to `draw_all`'s own import to raise."""

    def load() -> None:
        try:
            import matplotlib.backends.backend_svg  # noqa: F401, PLC0415
            import matplotlib.dates  # noqa: F401, PLC0415
            import matplotlib.figure  # noqa: F401, PLC0415
        except ImportError:
            pass

    t = threading.Thread(target=load, name="hsbuild-report-imports", daemon=True)
    t.start()
    return t


def require_matplotlib() -> Any:
    try:
        import matplotlib  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        raise UsageError(MISSING) from None
    return matplotlib, Figure


def draw_all(s: dict, names: tuple[str, ...] = FIGURES) -> dict[str, str]:
    """{figure name: inline SVG} for each figure of `names` (default: every one, FIGURES)."""
    matplotlib, figure = require_matplotlib()
    out = {}
    for name in names:
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name, "font.size": 9,
                                    "axes.spines.top": False, "axes.spines.right": False}):
            tall = name == "throughput"
            fig = figure(figsize=(WIDTH_IN, 4.6 if tall else 3.4))  # (margins set, not solved for: 2x faster)
            fig.subplots_adjust(left=0.065, right=0.93, top=0.92 if tall else 0.89, bottom=0.11 if tall else 0.17,
                                hspace=0.3, wspace=0.3)
            DRAW[name](fig, s)
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
        svg = buf.getvalue()
        out[name] = svg[svg.index("<svg"):]  # inline: no XML declaration or doctype
        out[name] = re.sub(r'<svg ([^>]*?)width="[^"]*" height="[^"]*"', r'<svg \1', out[name], count=1)
        out[name] = re.sub(r"<metadata>.*?</metadata>\s*", "", out[name], count=1, flags=re.S)  # (its RDF block)
    return out


def _times(s: dict) -> list[dt.datetime]:
    return [dt.datetime.fromtimestamp(t, dt.UTC) for t in s["axis"]["t"]]


def _step(ax: Any, s: dict, ys: list, **kw: Any) -> None:
    """A per-bucket series as steps, the last bucket drawn to its end."""
    a = s["axis"]
    ax.step(_times(s) + [_when(a["t0"] + a["buckets"] * a["bucket_s"])], list(ys) + list(ys[-1:]), where="post", **kw)


def _when(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def _time_axis(ax: Any, s: dict) -> None:
    import matplotlib.dates as mdates  # noqa: PLC0415

    a = s["axis"]
    ax.set_xlim(_when(a["t0"]), _when(a["t0"] + a["buckets"] * a["bucket_s"]))
    loc = mdates.AutoDateLocator(minticks=4, maxticks=10)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc))
    ax.set_xlabel("time (UTC)")


def _headroom(ax: Any, frac: float = 0.3) -> None:
    """Room above the data for the legend at the top: it never hides a line."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + (hi - lo) * frac)


def _counts(axis: Any) -> None:
    """Ticks at whole numbers on an axis of counts (no 1.25 samples)."""
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    axis.set_major_locator(MaxNLocator(integer=True))


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def _marks(ax: Any, s: dict, label: bool) -> None:
    """The runs' starts and ends, kills, engine checks and lost workers as lines; pauses and stalls as bands."""
    seen = set()
    for sp in s["events_marked"]["spans"]:
        name = {"pause": "paused (disk watermark)", "engine": "paused (engine)", "stall": "storage stall"}[sp["kind"]]
        ax.axvspan(_when(sp["a"]), _when(max(sp["b"], sp["a"] + s["axis"]["bucket_s"] / 4)), alpha=0.25,
                   color=SPAN_COLORS[sp["kind"]], lw=0, label=name if label and name not in seen else None)
        seen.add(name)
    for p in s["events_marked"]["points"]:
        color, style = POINT_STYLE.get(p["kind"], ("#888888", ":"))
        name = p["kind"].replace("_", " ")
        ax.axvline(_when(p["t"]), color=color, ls=style, lw=1.1, label=name if label and name not in seen else None)
        seen.add(name)


def draw_throughput(fig: Any, s: dict) -> None:
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    th, w = s["throughput"], s["axis"]["bucket_s"]
    _step(ax1, s, th["samples_per_s"], color=COLORS["written"], lw=1.2)
    ax1.set_ylabel("samples/s")
    ax1.set_title(f"1. Throughput over time (each point: {_width(w)}), with runs, pauses, stalls, engine and "
                  "interruptions", loc="left")
    _step(ax2, s, th["mb_per_s"], color="#72b7b2", lw=1.2)
    ax2.set_ylabel("MB/s (encoded)")
    _marks(ax1, s, label=True)
    _marks(ax2, s, label=False)
    handles, labels = ax1.get_legend_handles_labels()
    if handles:
        _headroom(ax1, 0.6)
        ax1.legend(handles, labels, fontsize=7, ncol=5, loc="upper right", framealpha=0.8)
    _time_axis(ax2, s)


def draw_states(fig: Any, s: dict) -> None:
    ax = fig.subplots()
    for st in ("written", "verified", "failed", "retired", "started", "pending"):
        _step(ax, s, s["states"][st], color=COLORS[st], lw=1.4, label=st)
    eta = s["eta"]
    left = (f"{eta['remaining']} left" + (f", about {_dur(eta['seconds'])} at {eta['samples_per_s']:.2f} samples/s "
                                          f"({eta['basis']})" if eta.get("seconds") else ""))
    ax.set_title(f"2. Samples by state over time; {left}", loc="left")
    ax.set_ylabel("samples")
    _counts(ax.yaxis)
    _headroom(ax, 0.2)
    ax.legend(fontsize=7, ncol=6, loc="upper left")
    _marks(ax, s, label=False)
    _time_axis(ax, s)


def _width(sec: float) -> str:
    """A bucket's width in its unit: 1 s, 5 min, 1 h, 2 d."""
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if sec >= n and sec % n == 0:
            return f"{sec / n:g} {unit}"
    return f"{sec:g} s"


def _dur(sec: float | None) -> str:
    if sec is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if sec >= n:
            return f"{sec / n:.1f} {unit}"
    return f"{sec:.0f} s"


def _hist(ax: Any, h: dict, color: str, what: str) -> None:
    if not h.get("samples"):
        _empty(ax, f"no {what} yet")
        return
    edges, counts = h["edges"], h["counts"]
    ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:], strict=False)], align="edge",
           color=color, edgecolor="white", lw=0.4)
    for q, style in (("median", "--"), ("p99", ":")):
        ax.axvline(h[q], color="#333333", ls=style, lw=1, label=f"{q} {h[q]}")
    ax.legend(fontsize=7)
    ax.set_ylabel("samples")
    _counts(ax.yaxis)


def draw_lengths(fig: Any, s: dict) -> None:
    gen = s.get("generated")
    axes = fig.subplots(1, 2 if gen else 1, squeeze=False)[0]
    h = s["lengths"]
    _hist(axes[0], h, COLORS["written"], "stored samples")
    axes[0].set_xlabel("tokens per stored sample")
    axes[0].set_title(f"3. Lengths: {h['samples']} stored samples, {h['tokens']:,} tokens" +
                      (f", mean {h['mean']:.0f}" if h.get("samples") else ""), loc="left")
    if gen:
        _hist(axes[1], gen["histogram"], "#72b7b2", "generated responses")
        axes[1].set_xlabel("generated tokens (final turn)")
        share = gen["truncated_share"]
        axes[1].set_title(f"regenerated: {gen['at_token_limit']} of {gen['samples']} stopped at the token limit "
                          f"({share:.1%})" + (f"; {gen['dropped_at_token_limit']} dropped"
                                              if gen["dropped_at_token_limit"] else ""), loc="left")


def draw_failures(fig: Any, s: dict) -> None:
    ax = fig.subplots()
    f = s["failures"]
    ax.set_title("4. Failures by reason over time (transient ones, retried uncounted, marked *)", loc="left")
    if not f["by_reason"]:
        _empty(ax, "no failure recorded")
        return
    a = s["axis"]
    t = _times(s) + [_when(a["t0"] + a["buckets"] * a["bucket_s"])]
    palette = ["#e45756", "#f58518", "#b279a2", "#9d755d", "#eeca3b", "#ff9da6", "#bab0ac", "#4c78a8"]
    ordered = sorted(f["by_reason"].items(), key=lambda kv: -sum(kv[1]))
    ax.stackplot(t, *[counts + counts[-1:] for _, counts in ordered], step="post", colors=palette[:len(ordered)],
                 labels=[f"{r}{' *' if r in f['transient'] else ''} ({f['totals'][r]})" for r, _ in ordered])
    ax.set_ylabel("failed events")
    _counts(ax.yaxis)
    _headroom(ax)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    _marks(ax, s, label=False)
    _time_axis(ax, s)


def draw_disk(fig: Any, s: dict) -> None:
    ax = fig.subplots()
    d = s["disk"]
    total = d["written_bytes"][-1] if d["written_bytes"] else 0
    unit, n = next(((u, n) for u, n in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if total >= n),
                   ("bytes", 1))
    _step(ax, s, [b / n for b in d["written_bytes"]], color=COLORS["written"], lw=1.4,
          label="written (each sample's share of its files' blocks)")
    ax.set_ylabel(f"{unit} written")
    _headroom(ax)
    ax.set_title(f"5. Bytes on disk over time: {human_bytes(total)} written; free space where the log recorded it",
                 loc="left")
    vol = d["volume"]
    if vol:
        ax2 = ax.twinx()
        ax2.plot([_when(v["t"]) for v in vol], [v["usage"] for v in vol], "o", color="#f58518",
                 label="volume used (at pause/resume)")
        last = vol[-1]
        for key, style in (("low", ":"), ("high", "--"), ("flood", "-")):
            if last.get(key) is not None:
                ax2.axhline(last[key], color="#e45756", ls=style, lw=0.9, label=f"{key} {last[key]:.0%}")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("volume used")
        ax2.legend(fontsize=7, loc="center right")
    ax.legend(fontsize=7, loc="upper left")
    _marks(ax, s, label=False)
    _time_axis(ax, s)


def draw_verification(fig: Any, s: dict) -> None:
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[3, 1])
    v = s["verification"]
    _step(ax1, s, [x if x is not None else float("nan") for x in v["share"]], color=COLORS["verified"])
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("share of stored samples verified")
    now = v["share_now"]
    ax1.set_title(f"6. Verification: {'-' if now is None else f'{now:.1%}'} of stored samples verified now, "
                  f"{v['sweeps']} sweep(s)", loc="left")
    _marks(ax1, s, label=False)
    _time_axis(ax1, s)
    bins = list(v["by_age"])
    ax2.barh(bins[::-1], [v["by_age"][b] for b in bins[::-1]], color=COLORS["verified"])
    ax2.set_title("last verified, before the last event", loc="left", fontsize=8)
    ax2.set_xlabel("stored samples")
    _counts(ax2.xaxis)


def draw_workers(fig: Any, s: dict) -> None:
    nodes = s.get("nodes") or []
    axes = fig.subplots(1, 2 if nodes else 1, squeeze=False)[0]
    ws = s["workers"]
    ax = axes[0]
    ax.set_title("7. Throughput per worker of each run (samples/s over the run's time extracting)", loc="left")
    if not ws:
        _empty(ax, "no sample written by a worker yet")
    else:
        names = [f"{w['run_id'][:8]} w{w['worker']}" for w in ws]
        ax.bar(range(len(ws)), [w["samples_per_s"] or 0 for w in ws], color=COLORS["written"])
        ax.set_xticks(range(len(ws)), names, rotation=45 if len(ws) > 8 else 0, ha="right" if len(ws) > 8 else "center",
                      fontsize=7)
        ax.set_ylabel("samples/s")
    if nodes:
        axn = axes[1]
        axn.bar(range(len(nodes)), [n["samples_per_s"] or 0 for n in nodes],
                color=[COLORS["failed"] if n["state"] == "gone" else "#72b7b2" for n in nodes])
        runs = {n["run_id"] for n in nodes}  # each node by its id (every node of a one-machine cluster: one host)
        axn.set_xticks(range(len(nodes)), [f"{str(n['node'])[:8]}" + (f"\n{n['host']}" if n["host"] else "")
                                           + (f"\nrun {n['run_id'][:8]}" if len(runs) > 1 else "") for n in nodes],
                       fontsize=7)
        axn.set_ylabel("samples/s")
        axn.set_title("per Ray node (red: gone)", loc="left")


DRAW = {"throughput": draw_throughput, "states": draw_states, "lengths": draw_lengths, "failures": draw_failures,
        "disk": draw_disk, "verification": draw_verification, "workers": draw_workers}
