"""Messages that point the right way: an interrupted run is not called a crash, a mistyped flag names its
subcommand, no absurd first rate, tables of sane width, gc's dry run, doctor's grammar, the runbook's queries."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import forked
import pytest
from conftest import worker_pids

from builder.cli.output import MAX_WIDTH
from builder.cli.progress import ProgressBar
from builder.layout import layout
from builder.log.query import status_snapshot

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"

# The stand-in owner: takes the build lock as a run does, records the events a run commits before its first
# sample is written (run_started, one `started`), then exits at once as the coordinator does on a second
# Ctrl-C (`interrupted`: after note_interrupted) or dies without a word (`killed`).
OWNER = r"""
import os, sys, uuid
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.log.lock import BuildLock, note_interrupted
lay = layout(sys.argv[1])
run_id = uuid.uuid4().hex
lock = BuildLock(lay, "run", run_id).acquire()
log = EventLog(lay.events)
sid, fp = log.query("SELECT sample_id, fingerprint FROM samples WHERE state = 'pending' ORDER BY sample_id LIMIT 1")[1][0]
log.append([Event("run_started", run_id=run_id), Event("started", run_id=run_id, sample_id=sid, fingerprint=fp,
                                                        attempt=1, worker=0)])
log.close()
if sys.argv[2] == "interrupted":
    assert note_interrupted(lay)
os._exit(130 if sys.argv[2] == "interrupted" else 137)
"""


def stand_in_owner(build: Path, how: str) -> None:
    cp = subprocess.run([sys.executable, "-c", OWNER, str(build), how], capture_output=True, text=True, timeout=120)
    assert cp.returncode == (130 if how == "interrupted" else 137), cp.stderr


def doctor_checks(cli, build: Path) -> dict[str, dict]:
    cp = cli("doctor", build, "--json")
    assert "Traceback" not in cp.stderr, cp.stderr
    return {c["name"]: c for c in json.loads(cp.stdout)["checks"]}


# -- 6a: an interrupted run is not a crash ---------------------------------------------------------------------


def test_a_run_interrupted_on_purpose_is_not_blamed_on_a_crash(make_build, cli):
    build = make_build(4)
    stand_in_owner(build, "interrupted")
    checks = doctor_checks(cli, build)
    lock, flight = checks["build.lock"], checks["build.interrupted"]
    assert lock["status"] == "ok" and "interrupted (Ctrl-C twice" in lock["summary"], lock
    assert "not a crash" in lock["summary"] and "dmesg" not in json.dumps(lock)
    assert flight["summary"].startswith("1 sample left `started` by a run that was interrupted (Ctrl-C twice"), flight
    assert "crash" not in flight["summary"]

    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert "dmesg" not in cp.stderr and "crash" not in cp.stderr, cp.stderr


def test_a_run_that_died_is_still_reported_as_one(make_build, cli):
    build = make_build(4)
    stand_in_owner(build, "killed")
    checks = doctor_checks(cli, build)
    assert checks["build.lock"]["status"] == "warn" and "killed or crashed" in checks["build.lock"]["summary"]
    assert "crash or kill" in checks["build.interrupted"]["summary"]
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert "dmesg" in cp.stderr  # the taken-over lock's fix: see why it stopped


def test_double_ctrl_c_then_resume_says_interrupted(make_build, cli, hold):
    n = 12
    build = make_build(n)
    lay = layout(build)
    # one sample a group: the first `written` commits at once; and the worker holds with its 3rd sample started
    # (the test hook), so the run cannot end by itself before the Ctrl-Cs (a run that already finished would take
    # them after releasing its lock, and test nothing)
    h = hold(3)
    env = dict(h.env, HSBUILD_GROUP_SAMPLES="1")
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--workers", "1", "--no-progress"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    workers: list[int] = []
    try:
        h.wait(proc=p)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (status_snapshot(lay).get("done", 0) >= 1 and worker_pids(p.pid)
                                                   and status_snapshot(lay).get("started", 0) >= 1):
            time.sleep(0.1)
        workers = worker_pids(p.pid)
        assert workers, "".join(err)
        for w in workers:  # hold the workers mid-run: the first Ctrl-C's safe stop waits for them
            os.kill(w, signal.SIGSTOP)
        assert status_snapshot(lay).get("done", 0) < n, "the run ended before it could be interrupted"
        p.send_signal(signal.SIGINT)
        while time.monotonic() < deadline and not any("stopping at a safe point" in line for line in err):
            time.sleep(0.05)
        assert any("stopping at a safe point" in line for line in err), "".join(err)
        p.send_signal(signal.SIGINT)  # the second: exit at once
        assert p.wait(timeout=60) == 130
    finally:
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()
    checks = doctor_checks(cli, build)
    assert checks["build.lock"]["status"] == "ok" and "interrupted (Ctrl-C twice" in checks["build.lock"]["summary"], (
        checks["build.lock"], "".join(err))
    assert "interrupted (Ctrl-C twice" in checks["build.interrupted"]["summary"]
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert "dmesg" not in cp.stderr and "crash" not in cp.stderr, cp.stderr


# -- 6b: a mistyped flag names its subcommand ----------------------------------------------------------------


def test_a_mistyped_subcommand_flag_names_the_subcommand(make_build, cli):
    build = make_build(2)
    cp = cli("run", build, "--wokers", "2")
    first = cp.stderr.splitlines()[0]
    assert cp.returncode == 2
    assert first.startswith("hsbuild run: error: unrecognized arguments: --wokers 2"), first
    assert "did you mean --workers?" in first and "`hsbuild run --help`" in first
    cp = cli("status", build, "--jsn")
    assert cp.returncode == 2 and cp.stderr.startswith("hsbuild status: error: unrecognized arguments: --jsn")
    assert "`hsbuild status --help`" in cp.stderr
    cp = cli("--nope", "status", build)  # a flag before the command is still the top level's
    assert cp.returncode == 2 and cp.stderr.startswith("hsbuild: error: unrecognized arguments: --nope")


# -- 6c: no absurd first rate ------------------------------------------------------------------------------


def test_the_progress_bar_shows_no_rate_until_it_means_something():
    now = [100.0]
    out = io.StringIO()
    bar = ProgressBar(out, enabled=True, clock=lambda: now[0])
    bar.start(100, "extract")
    now[0] = 130.0  # the model loaded; a first group of 8 results arrives at once
    bar.update(done=8, tokens=8000, nbytes=8 << 20)
    assert "8/100" in out.getvalue() and "samples/s" not in out.getvalue() and "measuring rate" in out.getvalue()
    now[0] = 134.0
    bar.update(done=12, tokens=12000, nbytes=12 << 20)
    last = out.getvalue().split("\r")[-1]
    assert "20/100 3.0 samples/s 3,000 tok/s" in last, last  # 12 results in the 4 s after the first group
    assert "ETA 0m26s" in last, last  # 80 more at 3 samples/s


# -- 6d: tables of sane width ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """A build with a run and then a verify sweep (the newest run is the sweep)."""
    from conftest import ROOMY, hsbuild, random_rows, write_jsonl  # noqa: PLC0415

    from builder.run.create import init_build  # noqa: PLC0415

    d = tmp_path_factory.mktemp("ran")
    src = write_jsonl(d / "src.jsonl", random_rows(6))
    build = init_build(d / "b", src, model="builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128",
                       watermarks=ROOMY).root
    hsbuild("run", build, "--no-progress", check=True)
    hsbuild("verify", build, "--no-progress", check=True)
    return build


def test_explain_prints_its_plan_whole_under_a_header_of_sane_width(ran, cli):
    q = "EXPLAIN SELECT state, count(*) FROM samples GROUP BY state"
    cp = cli("sql", ran, q)
    assert cp.returncode == 0, cp.stderr
    header, rule, *body = cp.stdout.splitlines()
    assert len(header) <= 2 * MAX_WIDTH and len(rule) <= 2 * MAX_WIDTH, header
    plan = json.loads(cli("sql", ran, q, "--json").stdout)[0]["explain_value"]
    for line in plan.splitlines():  # every line of the plan, uncut, in order
        assert any(line.rstrip() in b for b in body), line
    assert "cut" not in cp.stderr


def test_a_long_value_is_cut_and_the_note_says_how_to_see_it_whole(ran, cli):
    cp = cli("sql", ran, "SELECT run_id, kind, config FROM runs ORDER BY started_at")
    assert cp.returncode == 0
    assert all(len(line) <= 32 + 2 + len("extract") + 2 + MAX_WIDTH for line in cp.stdout.splitlines())
    assert "…" in cp.stdout and "--json or --csv prints every value whole" in cp.stderr


# -- 6e: gc's dry run ------------------------------------------------------------------------------------


def test_a_dry_run_with_nothing_to_remove_suggests_nothing(ran, cli):
    cp = cli("gc", ran, "--dry-run")
    assert cp.returncode == 0 and cp.stdout.strip() == "dry run: nothing to remove (no orphaned bytes)", cp.stdout
    orphan = layout(ran).data / f"zarr.{uuid.uuid4().hex}.partial"  # a temp file a killed writer left
    orphan.write_bytes(b"{}")
    try:
        cp = cli("gc", ran, "--dry-run")
        assert cp.returncode == 0 and f"remove with: hsbuild gc {ran}" in cp.stdout, cp.stdout
    finally:
        orphan.unlink()


# -- 6f: doctor's grammar --------------------------------------------------------------------------------


def test_doctor_says_it_for_one_sample(make_build, cli):
    build = make_build(3)
    stand_in_owner(build, "killed")
    s = doctor_checks(cli, build)["build.interrupted"]["summary"]
    assert s == "1 sample left `started` by a run that stopped abruptly (crash or kill) before finishing it; it is " \
                "extracted again", s


# -- 6g: the runbook's queries -----------------------------------------------------------------------------


def test_the_runbooks_preflight_query_answers_after_a_verify_sweep(ran, cli):
    text = RUNBOOK.read_text()
    q = re.search(r"-- preflight findings of the last run\n(.+)\n", text).group(1)
    cp = cli("sql", ran, q, "--json")
    assert cp.returncode == 0, cp.stderr
    rows = json.loads(cp.stdout)
    names = {r["name"] for r in rows}
    assert {"build.lock", "storage.space"} <= names, rows
    assert len(rows) == len(names)  # one preflight's findings, not several runs' mixed


# -- 7: the demo's hint works as printed ---------------------------------------------------------------------


def test_the_demos_next_hint_runs_as_printed_without_the_venv_on_path(tmp_path):
    script = Path(sys.executable).parent / "hsbuild"
    if not script.is_file():
        pytest.skip("no installed `hsbuild` script beside this Python (pip install -e .)")
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if Path(d).resolve() != script.parent.resolve())
    env = {**os.environ, "PATH": path}
    cp = subprocess.run([str(script), "demo", "demo-build", "--samples", "3", "--no-progress"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300, env=env)
    assert cp.returncode == 0, cp.stderr
    hint = next(line for line in cp.stdout.splitlines() if line.startswith("next: "))[len("next: "):]
    cp = subprocess.run(["bash", "-c", hint], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert cp.returncode == 0, (hint, cp.stderr)
    assert "written" in cp.stdout and "3" in cp.stdout, cp.stdout


def test_a_table_never_cuts_the_paths_and_ids_a_user_acts_on():
    """`hsbuild import` lists unusable dump files: a deep path (longer than a table column) is printed whole,
    where a long message beside it is cut."""
    import io

    from builder.cli.output import print_rows

    path = "/data/" + "/".join(f"dir{i:03d}" for i in range(30)) + "/data_3.ckpt"
    message = "x" * (MAX_WIDTH + 50)
    out = io.StringIO()
    print_rows(["path", "reason", "message"], [[path, "truncated", message]], "table", out=out, whole=["path"])
    row = out.getvalue().splitlines()[2]
    assert row.startswith(path + "  truncated  ")
    assert row.endswith("x" * (MAX_WIDTH - 1) + "…")


def test_ray_with_a_server_that_is_not_loopback_is_refused_before_anything_runs(tmp_path, tiny_llama, cli):
    """--ray on a vLLM build in connect mode: each node's worker talks to the server on its own node, so a
    server URL naming another host is refused (exit 2, naming the server and the way out), before Ray is even
    asked; nothing in the build changes."""
    from builder.run.create import init_build

    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": [5, 6, 7, 8]}) + "\n" for i in range(3)))
    (tmp_path / "staging").mkdir()
    build = init_build(tmp_path / "b", src, model=str(tiny_llama), backend="vllm", server="http://10.1.2.3:8000",
                       staging=str(tmp_path / "staging")).root
    before = (layout(build).events).read_bytes()
    cp = cli("run", build, "--ray", "127.0.0.1:6379", "--no-progress")
    assert cp.returncode == 2, cp.stderr
    first = cp.stderr.strip().splitlines()[0]
    assert "http://10.1.2.3:8000" in first and "loopback" in first and "--launch" in first, first
    assert "Traceback" not in cp.stderr
    assert layout(build).events.read_bytes() == before
