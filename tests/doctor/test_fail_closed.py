"""Preflight fails closed: a check that can block a run and crashes is a FAIL naming the check and the exception in
one line, so `run` refuses (exit 4) unless --force; it was a WARN, and the run started anyway.

What is faked: NVML, at its one boundary (`builder.doctor.gpu._nvml`, tests/doctor/fake_nvml.py): its process
query raises a TypeError, as a pynvml built for another driver does (not an NVMLError, which doctor handles).
torch's CUDA probe is faked to say "CUDA usable" (no GPU here). Everything else is real: the build, the run
(in this process: the CLI's main), its workers, the event log."""

from __future__ import annotations

import json

from fake_nvml import FakeGpu, FakeNVML
from test_doctor import fake_gpu_env

from builder.errors import EXIT_OK, EXIT_PREFLIGHT
from builder.layout import layout
from builder.log.events import EventLog

CRASH = "TypeError: c_nvmlProcessInfo_v3_t: expected 4 fields, the driver returned 3"


def test_a_blocking_check_that_crashes_fails_and_run_refuses_unless_forced(make_build, cli, monkeypatch):
    fake_gpu_env(monkeypatch, FakeNVML([FakeGpu(crash={"processes"})]), cuda=True, count=1)
    build = make_build(n=4, device="cpu")

    doc = cli("doctor", build, "--json")
    assert doc.returncode == EXIT_PREFLIGHT, doc.stdout + doc.stderr
    checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
    for name in ("gpu", "env.engine_orphans"):  # both ask NVML for its processes
        assert checks[name]["status"] == "fail" and CRASH in checks[name]["summary"], checks[name]
        assert checks[name]["data"]["crashed"] == CRASH
    assert checks["build.failed"]["status"] == "ok"  # (the others still ran)

    cp = cli("run", build, "--no-progress")
    assert cp.returncode == EXIT_PREFLIGHT, cp.stdout + cp.stderr
    said = [ln for ln in cp.stderr.splitlines() if CRASH in ln]
    assert said and said[0].strip().startswith(("env.engine_orphans:", "gpu:")), cp.stderr
    assert "--force" in cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.query("SELECT count(*) FROM events WHERE kind IN ('started', 'written')")[1] == [(0,)]

    cp = cli("run", build, "--no-progress", "--force")
    assert cp.returncode == EXIT_OK, cp.stdout + cp.stderr
    assert "preflight FAIL (--force): gpu:" in cp.stderr and CRASH in cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.query("SELECT count(*) FROM samples WHERE state = 'written'")[1] == [(4,)]
        forced = log.query("SELECT detail->>'$.forced' FROM events WHERE kind = 'doctor' ORDER BY seq")[1]
    assert forced[-1] == ("true",)
