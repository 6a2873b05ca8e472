"""The test hook (builder/run/testhook.py) stays out of the product's way: a malformed HSBUILD_TEST_HOLD is
refused when a run starts, in one line naming the variable and its form, before any sample is taken (it
crashed a worker mid-run); a process reads it once, and a process forked from it reads its own."""

from __future__ import annotations

import os

import pytest

from builder.layout import layout
from builder.log.events import EventLog
from builder.run import testhook


@pytest.mark.parametrize("value", ["x:{d}", "0:{d}", "3", "3:", "3:{d}/missing", "3:{d};two:{d}"])
def test_a_malformed_hold_is_refused_at_the_start_of_the_run(make_build, cli, tmp_path, value):
    build = make_build(4)
    raw = value.format(d=tmp_path)
    cp = cli("run", build, "--no-progress", "--workers", "1", env={**os.environ, testhook.ENV: raw})
    assert cp.returncode == 2, cp.stdout + cp.stderr
    errors = [line for line in cp.stderr.splitlines() if line.startswith("hsbuild run: error:")]
    assert len(errors) == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert testhook.ENV in errors[0] and "K:DIR" in errors[0], errors[0]
    with EventLog(layout(build).events, read_only=True) as log:  # no sample taken, no run begun
        assert log.query("SELECT count(*) FROM events WHERE kind IN ('run_started', 'started')")[1] == [(0,)]


def test_a_process_reads_the_hook_once_and_a_forked_child_reads_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(testhook, "_holds", None)
    monkeypatch.setenv(testhook.ENV, f"2:{tmp_path}")
    first = testhook.holds()
    assert first == [(2, tmp_path)]
    monkeypatch.setenv(testhook.ENV, "not read again")
    assert testhook.holds() is first  # read once: a task costs no parse
    monkeypatch.setenv(testhook.ENV, f"5:{tmp_path}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, repr(testhook.holds()).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        seen = f.read()
    os.waitpid(pid, 0)
    assert seen == repr([(5, tmp_path)])
