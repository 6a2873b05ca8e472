"""`hsbuild verify`: real builds, real damaged files, real subprocesses for the CLI and for interruptions."""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import forked
import numpy as np
import pytest
from conftest import same_states
from verify_helpers import (
    FIRST_RUN,
    N_SAMPLES,
    copy_build,
    events,
    inject_faults,
    live,
    sample_chunks,
    shared_template,
    sweep,
)

from builder.cli.app import main
from builder.config import load_config
from builder.errors import EXIT_BUSY, BuildLockedError, UsageError
from builder.extract.model import Extractor
from builder.extract.source import load_source
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.log.lock import BuildLock
from builder.log.query import run_query, status_snapshot
from builder.run.coordinator import RunOptions, run_build
from builder.store import reader as store_reader
from builder.store.readback import RETRIES
from builder.store.reader import SegmentReader
from builder.subset import stable_part
from builder.verify.selection import parse_time

ALL = {f"s{i:04d}" for i in range(N_SAMPLES)}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return shared_template(tmp_path_factory)


@pytest.fixture
def build(template, tmp_path):
    return copy_build(template, tmp_path / "b")


def _damage_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("DAMAGED "):
            sid, reason = line[len("DAMAGED "):].split(": ")[:2]
            out[sid] = reason
    return out


def test_verify_names_each_fault_and_resume_repairs_bit_exact(build, cli):
    expected = inject_faults(build)
    old = live(build)
    cp = cli("verify", build, "--no-progress")
    assert cp.returncode == 1, cp.stderr
    assert _damage_lines(cp.stdout) == expected
    assert "missing 9 | unreadable 2" in cp.stdout and "mismatched 1" in cp.stdout
    assert f"ok {N_SAMPLES - len(expected)} " in cp.stdout
    assert f"repair: hsbuild resume {build}" in cp.stdout
    assert f"hsbuild verify {build} --not-verified-since " in cp.stdout

    rows = live(build)  # the damage is in the log, queryable, and what resume re-extracts
    assert {sid: r["error"] for sid, r in rows.items() if r["state"] == "failed"} == expected
    assert all(r["state"] == "verified" and r["verified_at"] is not None for sid, r in rows.items()
               if sid not in expected)

    report = run_build(build, RunOptions(), resume=True, echo=lambda m: None)
    assert report.written == len(expected) and report.plan.damaged and len(report.plan.damaged) == len(expected)
    rows = live(build)
    for sid in expected:  # never into the damaged bytes: a fresh segment of this run
        assert rows[sid]["state"] == "written"
        assert rows[sid]["segment"] != old[sid]["segment"]
        assert rows[sid]["segment"].startswith(f"seg-{report.run_id[:8]}")

    s = sweep(build)
    assert (s.checked, s.ok, s.damaged, s.exit_code) == (N_SAMPLES, N_SAMPLES, [], 0)
    assert all(r["state"] == "verified" for r in live(build).values())
    assert s.orphans.count == 0  # the damaged bytes a superseded `written` references are kept, not orphans

    cfg = load_config(layout(build))
    src = {x.sample_id: x for x in load_source(cfg.source)}
    ex = Extractor(cfg.model, cfg.aux_layers, cfg.dtype, "cpu", final_state=cfg.final_state)
    reader = SegmentReader(layout(build).data)
    for sid in expected:
        r = rows[sid]
        got = reader.read(r["segment"], r["token_start"], r["num_tokens"])
        aux, final = ex.extract(src[sid].input_ids)
        for fld, ref in (("aux_hidden_state", aux), ("hidden_state", final)):  # the model's states (conftest)
            ok, why = same_states(got[fld], ref)
            assert ok, f"{sid} {fld}: {why}"
        assert np.array_equal(got["input_ids"].numpy(), src[sid].input_ids)
        assert np.array_equal(got["loss_mask"].numpy(), src[sid].loss_mask)


def test_json_output_and_fault_reasons(build, cli):
    expected = inject_faults(build)
    cp = cli("verify", build, "--json", "--jobs", "3")
    assert cp.returncode == 1, cp.stderr
    out = json.loads(cp.stdout)
    assert {d["sample_id"]: d["reason"] for d in out["damaged"]} == expected
    assert (out["checked"], out["mismatched"], out["missing"], out["unreadable"]) == (N_SAMPLES, 1, 9, 2)
    assert out["bytes_read"] > 0 and out["mb_per_s"] > 0 and out["exit_code"] == 1
    assert out["repair"][0].startswith(f"repair: hsbuild resume {build}")
    fails = events(build, "WHERE kind = 'failed'")
    assert {e["sample_id"]: e["reason"] for e in fails} == expected
    assert all(e["run_id"] == out["sweep_id"] and e["segment"] for e in fails)
    fin = events(build, "WHERE kind = 'verify_finished'")
    assert [e["reason"] for e in fin] == ["damage_found"]


def test_quick_checks_structure_without_reading(build):
    expected = inject_faults(build)
    s = sweep(build, quick=True)
    structural = {sid: r for sid, r in expected.items() if r != "checksum_mismatch"}  # a flipped bit keeps size
    assert {d.sample_id: d.reason for d in s.damaged} == structural
    assert s.bytes_read == 0 and s.checked == N_SAMPLES and s.exit_code == 1
    assert not events(build, "WHERE kind = 'verified'")  # quick never claims data was verified
    s = sweep(build)  # the full sweep then finds the flipped bit among the rest
    assert {d.sample_id: d.reason for d in s.damaged} == {"s0010": "checksum_mismatch"}
    assert s.checked == N_SAMPLES - len(structural)


def test_quick_flags_oversized_files_and_overlapping_samples(build):
    rows = live(build)
    chunk = sample_chunks(build, rows["s0009"], "hidden_state")[0]
    chunk.write_bytes(chunk.read_bytes() * 10)  # same name, implausible size
    b, c = rows["s0014"], rows["s0015"]
    with EventLog(layout(build).events) as log:  # a (buggy) log that gives two live samples the same bytes
        w = log.query_dicts("SELECT * FROM events WHERE kind = 'written' AND sample_id = 's0015'")[0]
        log.append([Event("written", run_id="bug", sample_id="s0015", fingerprint=w["fingerprint"],
                          attempt=w["attempt"], segment=b["segment"], token_start=b["token_start"],
                          num_tokens=c["num_tokens"], nbytes=w["nbytes"], checksums=w["checksums"])])
    s = sweep(build, quick=True)
    found = {d.sample_id: d for d in s.damaged}
    assert found["s0009"].reason == "unreadable" and "its index accounts for" in found["s0009"].message
    assert set(found) <= {"s0009", "s0015"}  # s0015's recorded size no longer matches the files it points at
    assert [(o.first, o.second) for o in s.overlaps] in ([("s0014", "s0015")], [("s0015", "s0014")])
    assert s.exit_code == 1


def test_subsets_cover_every_sample_exactly_once(build):
    seen: dict[str, list[str]] = {}
    for n in (1, 2, 3):
        s = sweep(build, subset=f"{n}/3")
        assert s.exit_code == 0
        ids = [e["sample_id"] for e in events(build, "WHERE kind = 'verified' AND run_id = ?", (s.sweep_id,))]
        assert len(ids) == s.checked == len(set(ids))
        assert all(stable_part(i, 3) == n - 1 for i in ids)
        for i in ids:
            seen.setdefault(i, []).append(f"{n}/3")
    assert set(seen) == ALL and all(len(v) == 1 for v in seen.values())
    assert 0 < min(sum(1 for v in seen.values() if v == [f"{n}/3"]) for n in (1, 2, 3))


def test_fraction_and_segment_and_not_verified_since(build):
    s = sweep(build, fraction=0.5, seed=11)
    again = sweep(build, fraction="0.5", seed="11")
    picked = {e["sample_id"] for e in events(build, "WHERE kind='verified' AND run_id = ?", (s.sweep_id,))}
    assert 0 < s.checked < N_SAMPLES and again.checked == s.checked
    assert picked == {e["sample_id"] for e in events(build, "WHERE kind='verified' AND run_id=?", (again.sweep_id,))}
    start = events(build, "WHERE kind = 'verify_started' AND run_id = ?", (s.sweep_id,))[0]
    assert json.loads(start["detail"])["selection"]["seed"] == 11

    seg = live(build)["s0000"]["segment"]
    s = sweep(build, segments=[seg])
    assert s.checked == FIRST_RUN

    # the post-incident sweep: everything not verified since the incident, naming the time in another zone
    incident = dt.datetime.now(dt.UTC)
    time.sleep(0.01)
    s1 = sweep(build, subset="1/3")
    s2 = sweep(build, not_verified_since=incident.astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat())
    assert s1.checked + s2.checked == N_SAMPLES
    s3 = sweep(build, not_verified_since=incident.replace(tzinfo=None).isoformat() + "Z")
    assert s3.checked == 0 and s3.exit_code == 0


def test_parse_time_is_utc():
    assert parse_time("2025-05-01T14:00:00+02:00") == dt.datetime(2025, 5, 1, 12)
    assert parse_time("2025-05-01T12:00:00Z") == dt.datetime(2025, 5, 1, 12)
    assert parse_time("2025-05-01") == dt.datetime(2025, 5, 1)


def test_max_rate_holds_within_20_percent(build):
    total = sum(r["nbytes"] for r in live(build).values())
    rate = total / 2.5 / 1e6  # a sweep of about 2.5 s
    s = sweep(build, max_rate=rate, jobs=2)
    assert s.checked == N_SAMPLES and s.bytes_read == total
    assert s.seconds > 2.0
    assert abs(s.mb_per_s - rate) / rate < 0.2, (s.mb_per_s, rate)


def _wait_verified(lay, at_least: int, proc: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended before it was interrupted: {proc.communicate()}")
        try:
            n = run_query(lay, "SELECT count(*) FROM events WHERE kind = 'verified'")[1][0][0]
        except Exception:  # noqa: BLE001 - the sweep may not own the build yet
            n = 0
        if n >= at_least:
            return n
        time.sleep(0.2)
    raise AssertionError("the sweep did not get far enough")


def _start_cli(*args: str) -> subprocess.Popen:
    return forked.Popen([sys.executable, "-m", "builder.cli", *map(str, args)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.claim("crash")
def test_continue_after_sigint_and_sigkill(build):
    lay = layout(build)
    total = sum(r["nbytes"] for r in live(build).values())
    slow = f"{total / 12 / 1e6:.6f}"  # a whole sweep would take ~12 s: 2 samples a second

    p1 = _start_cli("verify", build, "--max-rate", slow, "--jobs", "1", "--no-progress")
    _wait_verified(lay, 3, p1)
    p1.send_signal(signal.SIGINT)
    out, err = p1.communicate(timeout=30)
    assert p1.returncode == 130, err
    assert f"hsbuild verify {build} --continue" in out
    first = events(build, "WHERE kind = 'verify_started'")[0]["run_id"]
    k1 = len(events(build, "WHERE kind = 'verified' AND run_id = ?", (first,)))
    assert 3 <= k1 < N_SAMPLES - 6
    assert not events(build, "WHERE kind = 'verify_finished'")

    p2 = _start_cli("verify", build, "--continue", "--max-rate", slow, "--jobs", "1", "--no-progress")
    _wait_verified(lay, k1 + 2, p2)
    st = status_snapshot(lay)  # live status, answered by the sweep over its socket
    assert st["running"] and st["purpose"] == "verify" and st["total"] == N_SAMPLES and st["sweep"]["checked"] >= 2
    p2.kill()  # SIGKILL: only what was committed counts
    p2.communicate(timeout=30)
    second = events(build, "WHERE kind = 'verify_started'")[1]["run_id"]
    k2 = len(events(build, "WHERE kind = 'verified' AND run_id = ?", (second,)))
    assert k2 >= 2 and k1 + k2 < N_SAMPLES

    s3 = sweep(build, resume=True)
    assert s3.continues == second and s3.skipped == k1 + k2 and s3.checked == N_SAMPLES - k1 - k2
    verified = [e["sample_id"] for e in events(build, "WHERE kind = 'verified'")]
    assert sorted(verified) == sorted(ALL)  # every sample checked exactly once across the three sweeps
    fin = {e["run_id"]: e["reason"] for e in events(build, "WHERE kind = 'verify_finished'")}
    assert fin == {first: "continued", second: "continued", s3.sweep_id: "completed"}
    start3 = json.loads(events(build, "WHERE kind = 'verify_started' AND run_id = ?", (s3.sweep_id,))[0]["detail"])
    assert start3["chain"] == [first, second]
    with pytest.raises(UsageError, match="--continue"):
        sweep(build, resume=True)


def test_verify_after_write_records_verified(make_build):
    path = make_build(n=10)
    run_build(path, RunOptions(verify_after_write=True), echo=lambda m: None)
    rows = live(path)
    assert len(rows) == 10 and all(r["state"] == "verified" and r["verified_at"] for r in rows.values())
    ver = events(path, "WHERE kind = 'verified'")
    assert len(ver) == 10 and all(json.loads(e["detail"])["mode"] == "after_write" for e in ver)
    cols, out = run_query(layout(path), "SELECT count(*) FROM samples WHERE state = 'verified' "
                                        "AND verified_at IS NOT NULL")
    assert out[0][0] == 10
    assert sweep(path).ok == 10


@pytest.mark.parametrize("flags,flag", [
    (["--subset", "0/3"], "--subset"), (["--subset", "x"], "--subset"), (["--fraction", "1.5"], "--fraction"),
    (["--not-verified-since", "last tuesday"], "--not-verified-since"), (["--max-rate", "-1"], "--max-rate"),
    (["--jobs", "0"], "--jobs"), (["--seed", "3"], "--seed"), (["--segment", "seg-nope"], "--segment"),
    (["--continue", "--subset", "1/2"], "--continue"), (["--continue"], "--continue"),
])
def test_usage_errors_name_the_flag(build, capsys, flags, flag):
    assert main(["verify", str(build), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_verify_refuses_while_the_build_is_owned(build, cli):
    with BuildLock(layout(build), "run"):
        with pytest.raises(BuildLockedError):
            sweep(build)
        cp = cli("verify", build, "--quick")
        assert cp.returncode == EXIT_BUSY and "busy" in cp.stderr


def test_a_check_that_cannot_run_condemns_nothing(build, monkeypatch, capsys):
    """EMFILE (a full descriptor table) or a MemoryError while Zarr reads say nothing about the data: retried with
    backoff, then reported as not checked, the samples stay `written`, no `failed` event, exit 1 with a retry
    line; a transient EIO that clears on retry is just verified; a later sweep checks them and passes."""
    rows = live(build)
    emfile = {str(p) for p in sample_chunks(build, rows["s0005"], "hidden_state")}
    flaky = {str(p) for p in sample_chunks(build, rows["s0006"], "input_ids")}
    real_probe = store_reader.probe_file
    calls = {"emfile": 0, "eio": 0}

    def probe(path):  # the seam every data file is opened through before Zarr reads it
        if str(path) in emfile:
            calls["emfile"] += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        if str(path) in flaky and calls["eio"] < 2:
            calls["eio"] += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_probe(path)

    no_memory = {str(p) for p in sample_chunks(build, rows["s0007"], "aux_hidden_state")}
    real_open = pathlib.Path.open

    def open_(path, *a, **kw):  # how zarr's LocalStore reads part of a shard file, after the presence probe
        if str(path) in no_memory:
            raise MemoryError
        return real_open(path, *a, **kw)

    monkeypatch.setattr(store_reader, "probe_file", probe)
    monkeypatch.setattr(pathlib.Path, "open", open_)
    assert main(["verify", str(build), "--no-progress", "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "NOT CHECKED s0005: could not check: EMFILE" in out and "DAMAGED" not in out
    assert "NOT CHECKED s0007: could not check: MemoryError (4 tries)" in out
    assert f"retry:  hsbuild verify {build} --not-verified-since " in out and "repair:" not in out
    assert calls["emfile"] == 1 + RETRIES and calls["eio"] == 2  # retried with backoff

    after = live(build)
    for sid in ("s0005", "s0007"):
        assert after[sid]["state"] == "written" and after[sid]["segment"] == rows[sid]["segment"]
    assert after["s0006"]["state"] == "verified"  # the flaky read succeeded on a retry
    assert all(r["state"] == "verified" for sid, r in after.items() if sid not in ("s0005", "s0007"))
    assert not events(build, "WHERE kind = 'failed'")  # nothing condemned, nothing for resume to redo
    fin = events(build, "WHERE kind = 'verify_finished'")[-1]
    assert fin["reason"] == "check_errors" and json.loads(fin["detail"])["not_checked"] == ["s0005", "s0007"]

    monkeypatch.undo()
    since = events(build, "WHERE kind = 'verify_started'")[-1]["ts"]
    s = sweep(build, not_verified_since=since)  # the retry the CLI printed: only s0005 and s0007 are due
    assert (s.checked, s.ok, s.not_checked, s.damaged, s.exit_code) == (2, 2, [], [], 0)
    assert live(build)["s0005"]["state"] == live(build)["s0007"]["state"] == "verified"


def test_quick_sweep_reports_check_errors_not_damage(build, monkeypatch):
    victim = {str(p) for p in sample_chunks(build, live(build)["s0003"], "loss_mask")}
    real_probe = store_reader.probe_file

    def probe(path):
        if str(path) in victim:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))  # not transient: no retry
        return real_probe(path)

    monkeypatch.setattr(store_reader, "probe_file", probe)
    s = sweep(build, quick=True)
    assert [(n.sample_id, n.reason) for n in s.not_checked] == [("s0003", "check_error")]
    assert "EACCES" in s.not_checked[0].message and "(1 try)" in s.not_checked[0].message
    assert s.damaged == [] and s.exit_code == 1 and s.outcome == "check_errors"
    assert not events(build, "WHERE kind = 'failed'")
