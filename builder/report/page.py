"""The report page: one self-contained HTML file (charts inline as SVG, styles inline, no script, nothing fetched
at view time), written atomically (a temp file beside it, fsynced, renamed). It names the build, its model and its
configuration; every figure is drawn from the series `--json` prints."""

from __future__ import annotations

import datetime as dt
import errno
import html
import os
from pathlib import Path

from builder.errors import DiskFullError, UsageError
from builder.fsutil import fsync_path
from builder.humanize import human_bytes
from builder.layout import BuildLayout
from builder.report.charts import FIGURES, check_matplotlib, draw_all, preload_matplotlib
from builder.report.series import EARLY_FIGURES, collect

REPORT_NAME = "report.html"

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2em auto;max-width:1100px;color:#222;
padding:0 1em}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.05em;margin:1.4em 0 .3em}
table{border-collapse:collapse;font-size:.82em;margin:.4em 0}td,th{border-bottom:1px solid #ddd;padding:.15em .6em;
text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.k{color:#666}.bad{color:#c0392b;font-weight:600}figure{margin:.6em 0}figure svg{width:100%;height:auto}
pre{background:#f6f6f6;padding:.6em;font-size:.8em;overflow:auto}
.note{background:#fff4e0;border-left:4px solid #f58518;padding:.4em .8em;font-size:.92em}
"""

SECTIONS = {"throughput": "Throughput", "states": "Samples by state", "lengths": "Lengths",
            "failures": "Failures", "disk": "Bytes on disk", "verification": "Verification",
            "workers": "Workers and nodes"}


def default_output(lay: BuildLayout) -> Path:
    """BUILD/report.html, refused in one line where the build cannot be written (a read-only mount)."""
    root = lay.root
    ro = False
    try:
        ro = bool(os.statvfs(root).f_flag & os.ST_RDONLY) or not os.access(root, os.W_OK)
    except OSError:
        ro = True
    if ro:
        raise UsageError(f"{root}: the build cannot be written here (a read-only mount, or no write permission), so "
                         f"{REPORT_NAME} cannot go into it; give the page another place with -o FILE")
    return root / REPORT_NAME


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path`: a temp file beside it, fsynced, renamed over it, the folder fsynced; a failure leaves
    the file as it was and no temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{path}: no room to write the report ({e.strerror})") from None
        raise UsageError(f"{path}: cannot write the report ({e.strerror or e}); give another place with -o FILE") \
            from None


def make_report(lay: BuildLayout, out: Path | None = None) -> tuple[Path, dict]:
    """Collect the series, draw them, and write the page (default BUILD/report.html). Returns (path, series)."""
    target = Path(out) if out is not None else default_output(lay)
    if target.is_dir():
        raise UsageError(f"-o {target}: a folder; give the file to write, e.g. {target / REPORT_NAME}")
    check_matplotlib()  # (before reading anything: one line naming the extra)
    loading = preload_matplotlib()  # (its imports, while the log is read)
    svgs: dict[str, str] = {}

    def draw_early(light: dict) -> None:  # (while the heaviest statements are still asked)
        loading.join()
        svgs.update(draw_all(light, EARLY_FIGURES))

    series = collect(lay, on_light=draw_early)
    svgs.update(draw_all(series, tuple(f for f in FIGURES if f not in svgs)))
    write_atomic(target, render(series, svgs))
    return target, series


def _t(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _e(v: object) -> str:
    return html.escape("" if v is None else str(v))


def _table(head: list[str], rows: list[list[object]]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def render(s: dict, svgs: dict[str, str]) -> str:
    b, now = s["build"], s["now"]
    live = b["live"]
    fmt = b.get("format") or {}
    state = (f"running: {live['purpose']} {str(live['run_id'] or '')[:8]} (pid {live['pid']})" if live["running"]
             else "idle: no run is going")
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>hsbuild report: {_e(b['path'])}</title><style>{CSS}</style></head><body>",
        f"<h1>hsbuild report: <code>{_e(b['path'])}</code></h1>",
        f"<p><span class='k'>model</span> {_e(b['model'])} <span class='k'>(fingerprint {_e(b['model_fingerprint'])})"
        f"</span> · <span class='k'>source</span> {_e(b['source'])} · <span class='k'>created</span> "
        f"{_e(_t(b['created_at']))}<br><span class='k'>{_e(state)}</span> · {b['events']:,} events, the last at "
        f"{_e(_t(now.get('last_event_at')))}</p>",
        _rebuilt(s),
        _table(["samples", "done", "written", "verified", "failed", "in flight", "pending", "retired", "tokens",
                "data"],
               [[now["total"], now["done"], now["written"], now["verified"], now["failed"], now["started"],
                 now["pending"], now["retired"], f"{now['tokens_done']:,} of {now['tokens_total']:,}",
                 human_bytes(now["bytes_done"])]]),
        "<h2>Configuration</h2>",
        _table(["format key", "value"], [[k, "none" if v is None else v] for k, v in fmt.items()]) if fmt else "",
        ("<details><summary>hsbuild.toml as the last run read it</summary>"
         f"<pre>{_e(b['config'])}</pre></details>" if b.get("config") else ""),
        "<h2>Runs and sweeps</h2>", _runs(s),
    ]
    for name in FIGURES:
        parts.append(f"<h2>{_e(SECTIONS[name])}</h2><figure id='fig-{name}'>{svgs[name]}</figure>")
        parts.append(EXTRA.get(name, lambda _s: "")(s))
    parts.append("<p class='k'>Made by <code>hsbuild report</code> from the build's event log alone; every series "
                 "above is in <code>hsbuild report BUILD --json</code>.</p></body></html>")
    return "\n".join(parts)


def _rebuilt(s: dict) -> str:
    """A log rebuilt by `hsbuild rebuild-log`: what its history before the rebuild is (docs/design.md section 11)."""
    out = ""
    for r in s.get("rebuilt") or []:
        out += (f"<p class='note'><b>This log was rebuilt</b> from the data by <code>hsbuild rebuild-log</code> at "
                f"{_e(_t(r['t']))}. The history before then is what it could restore: each sample's state, location "
                f"and sweep verdicts ({_e(r['written'])} written, {_e(r['verified'])} of them verified by a sweep, "
                f"{_e(r['skipped'])} skipped" + (f", {_e(r['failed'])} found damaged on reading back" if r["failed"] else "")
                + "), every one stamped with the rebuild's time, so the charts show them "
                "there (restored, not extracted: not counted as throughput). The runs, pauses, stalls, failures, "
                "attempt counts and event times before it were in the lost log only.</p>")
    return out


def _runs(s: dict) -> str:
    marks = {p["run_id"]: p for p in s["events_marked"]["points"] if p["kind"] == "killed"}
    rows = []
    for r in s["runs"]:
        outcome = "killed (no end record)" if r["run_id"] in marks else r["outcome"]
        rows.append([r["run_id"][:8], r["kind"], _t(r["started_at"]), outcome, r["written"], r["verified"],
                     r["failed"], r["pauses"], r["duration_s"], r["active_s"], r["samples_per_s"], r["mb_per_s"]])
    if not rows:
        return "<p class='k'>no run yet</p>"
    return _table(["run", "kind", "started", "outcome", "written", "verified", "failed", "pauses", "wall s",
                   "extracting s", "samples/s", "MB/s"], rows)


def _failures(s: dict) -> str:
    most = s["failures"]["most"]
    if not most:
        return ""
    return "<p>The samples that failed most:</p>" + _table(
        ["sample", "failures", "reasons", "last reason", "state now", "attempts"],
        [[m["sample_id"], m["failures"], m["reasons"], m["last_reason"], m["state"], m["attempts"]] for m in most])


def _workers(s: dict) -> str:
    ws = s["workers"]
    out = ""
    if ws:
        out += _table(["run", "worker", "written", "tokens", "data", "samples/s", "MB/s"],
                      [[w["run_id"][:8], w["worker"], w["written"], w["tokens"], human_bytes(w["nbytes"]),
                        _r(w["samples_per_s"]), _r(w["mb_per_s"])] for w in ws])
    if s.get("nodes"):
        out += _table(["run", "node", "host", "workers", "lost", "written", "samples/s", "state"],
                      [[n["run_id"][:8], str(n["node"])[:12], n["host"], n["workers"], n["workers_lost"], n["written"],
                        _r(n["samples_per_s"]), n["state"]] for n in s["nodes"]])
    return out


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


EXTRA = {"failures": _failures, "workers": _workers}
