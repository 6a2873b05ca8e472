"""`hsbuild report` (issue 45) over a real build with a history: a run killed with kill -9 and resumed, a watermark
pause on a real small filesystem (a tmpfs), a failed sample, a skip and a verify. Its `--json` series are the
numbers SQL over the log (and the fold's Python reference) gives; it works live (through the owner), on a rebuilt
log, refuses a read-only build without -o in one line, and names the extra when matplotlib is missing. The page is
rendered in a real headless browser (Chromium from the OS packages; .ci/run installs it): a screenshot that is not
blank, no console error, every chart in the DOM. Without Chromium that test skips saying why;
HSBUILD_REQUIRE_CHROMIUM=1 (set in .ci/run) makes the skip a failure."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import forked
import pytest
from browser import chromium, console_errors, figure_svg, render
from conftest import Hold, mounted_tmpfs, random_rows, wait_for, write_jsonl

from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.log.fold import fold

pytest.importorskip("matplotlib", reason="hsbuild report needs the `report` extra (matplotlib)")
import matplotlib.image as mpimg  # noqa: E402

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128,nan_token=7"
FIGURES = ("throughput", "states", "lengths", "failures", "disk", "verification", "workers")


def usage(mnt: Path) -> float:
    st = os.statvfs(mnt)
    return 1 - st.f_bavail / st.f_blocks


def fill_to(mnt: Path, filler: Path, frac: float) -> None:
    st = os.statvfs(mnt)
    total = st.f_blocks * st.f_frsize
    others = (st.f_blocks - st.f_bavail) * st.f_frsize - (filler.stat().st_size if filler.exists() else 0)
    filler.write_bytes(b"\0" * int(total * frac - others))


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """The build, its report while paused (live), and the tmpfs it lives on (mounted for the module)."""
    from cli_runner import hsbuild

    tmp = tmp_path_factory.mktemp("report")
    with mounted_tmpfs(tmp / "vol", "32m") as mnt:
        rows = random_rows(14, seed=3, lo=40, hi=120)
        rows[3]["input_ids"][0] = 7  # the model's poisoned token: NaN states, failed `nonfinite`
        src = write_jsonl(tmp / "src.jsonl", rows)
        build = mnt / "build"
        cp = hsbuild("init", build, "--source", src, "--model", MODEL)
        assert cp.returncode == 0, cp.stderr
        # run 1, killed with kill -9 while its worker holds its 6th sample (5 behind it written: one a group)
        hold = Hold(tmp / "hold", 6)
        env = {**hold.env, "HSBUILD_GROUP_SAMPLES": "1"}
        p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        hold.wait(1, proc=p)
        p.kill()
        p.wait(30)
        # the volume past the high watermark: the resume pauses at once, and resumes once the filler goes
        filler = mnt / "filler"
        fill_to(mnt, filler, 0.92)
        p = forked.Popen([sys.executable, "-m", "builder.cli", "resume", str(build), "--no-progress", "--workers", "1",
                          "--allow-overcommit"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HSBUILD_GROUP_SAMPLES": "1"})
        try:
            def paused():
                cp = hsbuild("status", build, "--json")
                st = json.loads(cp.stdout) if cp.returncode == 0 else {}
                return st if st.get("paused") else None

            wait_for(paused, 120, "the pause", p)
            live = hsbuild("report", build, "-o", tmp / "live.html", "--json")
            live_sql = hsbuild("sql", build, "SELECT state, count(*) AS n FROM samples GROUP BY state", "--json")
            filler.unlink()
            out, err = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 1 and "PAUSED (high_watermark)" in err, err  # (the failed sample: exit 1)
        assert hsbuild("skip", build, "s0010", "--reason", "a test skip").returncode == 0
        cp = hsbuild("verify", build, "--no-progress")
        assert cp.returncode == 0, cp.stdout + cp.stderr
        bad = sorted(r["id"] for r in rows if 7 in r["input_ids"])
        assert "s0003" in bad and "s0010" not in bad
        yield {"build": build, "tmp": tmp, "mnt": mnt, "live": live, "live_sql": live_sql, "bad": bad}


def report_json(build: Path, *flags: object) -> dict:
    from cli_runner import hsbuild

    cp = hsbuild("report", build, *flags, "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def events_of(build: Path) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts("SELECT *, epoch(ts) AS t FROM events ORDER BY seq")


def test_series_are_what_sql_over_the_log_gives(history, tmp_path):
    build = history["build"]
    before = sorted((p.relative_to(build), p.stat().st_size, p.stat().st_mtime_ns) for p in build.rglob("*")
                    if p.name != "report.html")
    s = report_json(build, "-o", tmp_path / "r.html")
    ev = events_of(build)
    after = sorted((p.relative_to(build), p.stat().st_size, p.stat().st_mtime_ns) for p in build.rglob("*")
                   if p.name != "report.html")
    assert before == after  # the log and the data untouched
    a = s["axis"]
    t0, w, nb = a["t0"], a["bucket_s"], a["buckets"]
    assert t0 == ev[0]["t"] and a["t1"] == ev[-1]["t"] and nb == int((ev[-1]["t"] - t0) // w) + 1

    def bucket(e: dict) -> int:
        return math.floor((e["t"] - t0) / w)

    # 1. throughput: samples extracted and their bytes per bucket (those a resume adopted from the killed run's
    # durable groups counted apart: recorded at the resume's start, extracted before the kill)
    written = [e for e in ev if e["kind"] == "written"]
    adopted = [e for e in written if json.loads(e["detail"] or "{}").get("adopted")]
    extracted = [e for e in written if e not in adopted]
    per = Counter(bucket(e) for e in extracted)
    assert s["throughput"]["samples"] == [per.get(i, 0) for i in range(nb)]
    per_adopted = Counter(bucket(e) for e in adopted)
    assert s["throughput"]["adopted"] == [per_adopted.get(i, 0) for i in range(nb)]
    assert not any(s["throughput"]["restored"])
    nbytes = defaultdict(int)
    for e in extracted:
        nbytes[bucket(e)] += e["nbytes"]
    # rates over each bucket's seconds: the last one's, the part the log covers (its last event), at least 1 s
    last = min(w, max(ev[-1]["t"] - (t0 + (nb - 1) * w), 1.0))
    assert a["last_bucket_s"] == pytest.approx(last)
    secs = [w] * (nb - 1) + [last]
    assert s["throughput"]["mb_per_s"] == pytest.approx([nbytes.get(i, 0) / 1e6 / secs[i] for i in range(nb)])
    assert s["throughput"]["samples_per_s"] == pytest.approx([per.get(i, 0) / secs[i] for i in range(nb)])
    # the kill, the pause, the runs
    runs = [e for e in ev if e["kind"] == "run_started"]
    assert len(runs) == 2
    ended = {e["run_id"] for e in ev if e["kind"] == "run_finished"}
    killed = [p for p in s["events_marked"]["points"] if p["kind"] == "killed"]
    first = runs[0]["run_id"]
    assert first not in ended and [(p["run_id"], p["t"]) for p in killed] == [
        (first, max(e["t"] for e in ev if e["run_id"] == first))]
    pauses = [e for e in ev if e["kind"] in ("paused", "resumed")]
    assert [e["kind"] for e in pauses] == ["paused", "resumed"] and pauses[0]["reason"] == "high_watermark"
    assert [(sp["kind"], sp["a"], sp["b"], sp["reason"]) for sp in s["events_marked"]["spans"]] == [
        ("pause", pauses[0]["t"], pauses[1]["t"], "high_watermark")]
    # 2. states over time: at the end of every bucket, each sample's state by the fold's Python reference
    by_sample = defaultdict(list)
    for e in ev:
        if e["sample_id"] is not None:
            by_sample[e["sample_id"]].append(e)
    with EventLog(layout(build).events, read_only=True) as log:
        registered = log.query("SELECT count(*) FROM source_samples")[1][0][0]
        view = dict(log.query("SELECT state, count(*) FROM samples GROUP BY state")[1])
        prog = log.query_dicts("SELECT * FROM progress")[0]
    for i in range(nb):
        counts = Counter(fold(Event(**{k: e[k] for k in ("kind", "seq", "reason", "segment", "token_start",
                                                             "num_tokens", "detail")})
                              for e in es if bucket(e) <= i).state for es in by_sample.values())
        counts["pending"] += registered - len(by_sample)
        assert {k: s["states"][k][i] for k in s["states"]} == {k: counts.get(k, 0) for k in s["states"]}, i
    assert {k: v[-1] for k, v in s["states"].items() if v[-1]} == view
    bad = history["bad"]
    assert view == {"failed": len(bad), "retired": 1, "verified": 14 - len(bad) - 1}
    for k in ("total", "pending", "written", "verified", "failed", "retired", "done", "remaining", "tokens_done",
              "tokens_total", "bytes_done", "disk_bytes_done"):
        assert s["now"][k] == prog[k], k
    # 3. lengths: the stored samples' tokens
    with EventLog(layout(build).events, read_only=True) as log:
        toks = [r[0] for r in log.query("SELECT num_tokens FROM samples WHERE state IN ('written', 'verified')")[1]]
    h = s["lengths"]
    assert (h["samples"], h["tokens"], h["min"], h["max"]) == (len(toks), sum(toks), min(toks), max(toks))
    edges = h["edges"]
    assert h["counts"] == [sum(edges[j] <= x < edges[j + 1] for x in toks) for j in range(len(edges) - 1)]
    assert s["generated"] is None  # not a regenerating build
    # 4. failures by reason over time, and the samples that failed most
    failed = [e for e in ev if e["kind"] == "failed"]
    assert s["failures"]["totals"] == dict(Counter(e["reason"] for e in failed)) and set(s["failures"]["totals"]) == {
        "nonfinite"}
    for reason, series in s["failures"]["by_reason"].items():
        c = Counter(bucket(e) for e in failed if e["reason"] == reason)
        assert series == [c.get(i, 0) for i in range(nb)]
    most = sorted(Counter(e["sample_id"] for e in failed).items(), key=lambda kv: (-kv[1], kv[0]))
    assert [(m["sample_id"], m["failures"], m["state"]) for m in s["failures"]["most"]] == [
        (sid, n, "failed") for sid, n in most[:10]] and {sid for sid, _ in most} == set(bad)
    # 5. bytes on disk: each written sample's share of its group's blocks, cumulative
    # (a sample adopted after a kill records no disk share: its encoded bytes stand for it, as in `progress`)
    disk = [json.loads(e["detail"] or "{}").get("disk_bytes", e["nbytes"]) for e in written]
    assert s["disk"]["written_bytes"][-1] == sum(disk)
    vol = s["disk"]["volume"]
    assert [v["kind"] for v in vol] == ["paused", "resumed"] and vol[0]["usage"] >= 0.90 > vol[0]["high"] - 0.001
    assert vol[1]["usage"] < 0.85
    # 6. verification: every stored sample verified, by one sweep, just now
    v = s["verification"]
    assert v["share_now"] == 1.0 and v["sweeps"] == 1 and v["share"][-1] == 1.0
    assert v["by_age"]["within 1 h"] == view["verified"] and v["by_age"]["never"] == 0
    # 7. per worker
    # (samples adopted from a killed run's durable groups name no worker: written by none of the run's)
    per_worker = Counter((e["run_id"], e["worker"]) for e in written if e["worker"] is not None)
    assert {(x["run_id"], x["worker"]): x["written"] for x in s["workers"]} == dict(per_worker)
    # the page names the build, its model and its configuration
    page = (tmp_path / "r.html").read_text()
    assert str(build) in page and MODEL.split(",")[0] in page and "max_attempts" in page
    assert s["build"]["model"] == MODEL and "[watermarks]" in s["build"]["config"]


def test_a_live_build_is_reported_through_its_owner(history):
    """Asked while the resume was paused (alive, owning the build): its owner answered, and the counts are the
    ones `sql` got from it at that moment."""
    cp = history["live"]
    assert cp.returncode == 0, cp.stderr
    s = json.loads(cp.stdout)
    assert s["build"]["live"]["running"] and s["build"]["live"]["purpose"] == "run"
    sql = {r["state"]: r["n"] for r in json.loads(history["live_sql"].stdout)}
    assert {k: v[-1] for k, v in s["states"].items() if v[-1]} == sql
    assert [sp["ended"] for sp in s["events_marked"]["spans"]] == [False]  # the pause, still going
    assert not [p for p in s["events_marked"]["points"] if p["kind"] == "killed" and p["run_id"] == s["build"]["live"][
        "run_id"]]


def test_a_rebuilt_log_is_reported(history, tmp_path):
    from cli_runner import hsbuild

    copy = tmp_path / "copy"
    shutil.copytree(history["build"], copy, ignore=shutil.ignore_patterns("hsbuild.sock", "report.html"))
    orig = report_json(history["build"], "-o", tmp_path / "a.html")
    (copy / "events.duckdb").unlink()
    cp = hsbuild("rebuild-log", copy, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    s = report_json(copy)
    assert (copy / "report.html").is_file()
    with EventLog(layout(copy).events, read_only=True) as log:
        view = dict(log.query("SELECT state, count(*) FROM samples GROUP BY state")[1])
    assert {k: v[-1] for k, v in s["states"].items() if v[-1]} == view
    for k in ("written", "verified", "retired", "tokens_done"):
        assert s["now"][k] == orig["now"][k], k
    assert [p for p in s["events_marked"]["points"] if p["kind"] == "log_rebuilt"]
    # the restored samples carry the rebuild's time: counted apart, not as throughput; the page says what the
    # history before the rebuild is
    with EventLog(layout(copy).events, read_only=True) as log:
        (written,) = log.query("SELECT count(*) FROM events WHERE kind = 'written'")[1][0]
        (t_rebuilt,) = log.query("SELECT epoch(ts) FROM events WHERE kind = 'log_rebuilt'")[1][0]
    assert sum(s["throughput"]["restored"]) == written  # (an older durable attempt too: a superseded `written`)
    assert not any(s["throughput"]["samples"]) and not any(s["throughput"]["mb_per_s"])
    assert s["disk"]["written_bytes"][-1] > 0  # their bytes are on disk all the same
    live = view.get("written", 0) + view["verified"]
    assert [(r["t"], r["written"], r["verified"]) for r in s["rebuilt"]] == [(t_rebuilt, live, view["verified"])]
    assert "This log was rebuilt" in (copy / "report.html").read_text()
    assert orig["rebuilt"] == [] and sum(orig["throughput"]["restored"]) == 0


def test_a_read_only_build_needs_o(history, tmp_path):
    from cli_runner import hsbuild

    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", str(history["build"]), str(ro)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        cp = hsbuild("report", ro)
        assert cp.returncode == 2 and len(cp.stderr.strip().splitlines()) == 1 and "-o FILE" in cp.stderr, cp.stderr
        cp = hsbuild("report", ro, "-o", tmp_path / "ro.html")
        assert cp.returncode == 0 and (tmp_path / "ro.html").stat().st_size > 10_000, cp.stderr
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_without_matplotlib_one_line_names_the_extra(history, tmp_path):
    out = tmp_path / "x.html"
    code = ("import sys; sys.modules['matplotlib'] = None; from builder.cli.app import main; "
            f"sys.exit(main(['report', {str(history['build'])!r}, '-o', {str(out)!r}]))")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert cp.returncode == 2 and "pip install 'hsbuild[report]'" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and not out.exists()


def test_the_page_renders_in_chromium(history, tmp_path):
    from cli_runner import hsbuild

    browser = chromium()
    page = tmp_path / "report.html"
    assert hsbuild("report", history["build"], "-o", page).returncode == 0
    png = tmp_path / "report.png"
    dom, log = render(browser, page, png)
    assert not console_errors(log), console_errors(log)
    for name in FIGURES:  # every chart, drawn (an SVG inside its figure)
        assert figure_svg(dom, name), name
    img = mpimg.imread(png)[..., :3]
    assert img.shape[0] >= 1000 and img.std() > 0.05  # not a blank page
    html = page.read_text()  # nothing fetched at view time: no script, no link or source elsewhere
    assert "<script" not in html and not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\(\s*["']?https?:""", html)
