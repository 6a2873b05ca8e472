"""`hsbuild resume` on a complete build answers from the log (builder/run/settled.py): no event recorded, no
worker started; and every build with work left, or that it cannot vouch for, is still resumed the long way.
Real builds (the built-in model), the real CLI, real DuckDB logs and data files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import mounted_tmpfs, random_rows, set_config, write_jsonl

from builder.config import BuildConfig
from builder.layout import layout
from builder.log.events import Event, EventLog
from builder.run import settled


@pytest.fixture
def no_racy_wait(monkeypatch):
    """A source written a moment before its run gets an identity all the same (else the tests would wait
    RACY_SECONDS after writing each source; the rule itself: test_a_source_modified_just_before_the_run...)."""
    monkeypatch.setattr(settled, "RACY_SECONDS", 0.0)


def _events(build: Path) -> int:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query("SELECT count(*) FROM events")[1][0][0]


def _runs(build: Path) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts("SELECT run_id, json_extract(detail, '$.source_stat') AS stat FROM events "
                               "WHERE kind = 'run_started' ORDER BY seq")


def _states(build: Path) -> dict[str, str]:
    with EventLog(layout(build).events, read_only=True) as log:
        return dict(log.query("SELECT sample_id, state FROM samples")[1])


def _source(build: Path) -> Path:
    return Path(BuildConfig.from_toml(layout(build).config).source)


def _nothing_to_do(cli, build: Path) -> str:
    """A resume answered from the log: exit 0, no event recorded. Returns its stdout."""
    before = _events(build)
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "nothing to do" in cp.stdout and "wrote 0, failed 0" in cp.stdout, cp.stdout + cp.stderr
    assert _events(build) == before, "a resume with nothing to do recorded events"
    return cp.stdout


def _long_way(cli, build: Path, *flags: str, code: int = 0) -> str:
    """A resume that ran (a run recorded), with exit `code`. Returns its stdout."""
    runs = len(_runs(build))
    cp = cli("resume", build, "--no-progress", *flags)
    assert cp.returncode == code, cp.stdout + cp.stderr
    assert "nothing to do" not in cp.stdout, cp.stdout
    if code in (0, 1):
        assert len(_runs(build)) == runs + 1, "the resume did not run"
    return cp.stdout


def test_a_complete_build_resumes_without_recording_and_skips_still_count(make_build, cli, no_racy_wait):
    build = make_build(6)
    assert cli("run", build, "--no-progress").returncode == 0
    stat = json.loads(_runs(build)[-1]["stat"])
    st = os.stat(_source(build))
    assert (stat["path"], stat["ino"], stat["size"], stat["ctime_ns"]) == (str(_source(build)), st.st_ino,
                                                                             st.st_size, st.st_ctime_ns)
    out = _nothing_to_do(cli, build)
    assert "6 done, 0 retired" in out, out
    _nothing_to_do(cli, build)  # (and again: nothing accumulates)

    # a skipped sample is retired: still nothing to do; un-skipped, it is pending again and the resume writes it
    assert cli("skip", build, "s0002", "--reason", "test").returncode == 0
    assert "5 done, 1 retired" in _nothing_to_do(cli, build)
    assert cli("skip", build, "s0002", "--undo").returncode == 0
    assert "wrote 1, failed 0" in _long_way(cli, build)
    assert set(_states(build).values()) == {"written"}
    _nothing_to_do(cli, build)


def test_a_changed_source_is_resumed(make_build, cli, no_racy_wait):
    build = make_build(6)
    assert cli("run", build, "--no-progress").returncode == 0
    src = _source(build)
    rows = [json.loads(line) for line in src.read_text().splitlines()]

    # a row appended: a new sample, registered and written
    write_jsonl(src, [*rows, {**random_rows(1, seed=9)[0], "id": "appended"}])
    assert "wrote 1, failed 0" in _long_way(cli, build)
    _nothing_to_do(cli, build)

    # one token of a written sample changed, the file's size the same: refused as a change, never "done"
    text = src.read_text()
    first = json.loads(text.splitlines()[0])
    tok = first["input_ids"][0]
    other = tok + 1 if len(str(tok + 1)) == len(str(tok)) else tok - 1
    edited = text.replace(json.dumps(first), json.dumps({**first, "input_ids": [other, *first["input_ids"][1:]]}), 1)
    assert len(edited) == len(text) and edited != text
    src.write_text(edited)
    _long_way(cli, build, code=2)
    assert "wrote 1, failed 0" in _long_way(cli, build, "--accept-source-changes")
    _nothing_to_do(cli, build)

    # a config whose format changed is the long way's to refuse, as before
    set_config(build, max_tokens=16)
    _long_way(cli, build, code=2)


def test_damaged_failed_and_requeued_samples_are_resumed(make_build, cli, no_racy_wait):
    build = make_build(6)
    assert cli("run", build, "--no-progress").returncode == 0
    _nothing_to_do(cli, build)

    # damage found by verify: the samples whose shard file is gone are extracted again
    shard = next(p for p in sorted(layout(build).data.glob("seg-*/hidden_state/c.*")) if p.is_file())
    shard.unlink()
    assert cli("verify", build, "--quick").returncode == 1
    damaged = [s for s, state in _states(build).items() if state == "failed"]
    assert damaged
    assert f"wrote {len(damaged)}, failed 0" in _long_way(cli, build)
    _nothing_to_do(cli, build)

    # a sample the environment sent back (a transient failure: pending, not failed) is extracted again
    with EventLog(layout(build).events) as log:
        log.append([Event("started", run_id="t", sample_id="s0004", attempt=9),
                    Event("failed", run_id="t", sample_id="s0004", attempt=9, reason="no_space")])
    assert _states(build)["s0004"] == "pending"
    assert "wrote 1, failed 0" in _long_way(cli, build)
    _nothing_to_do(cli, build)

    # a sample left in flight (a run killed): extracted again
    with EventLog(layout(build).events) as log:
        log.append([Event("started", run_id="t2", sample_id="s0001", attempt=11)])
    assert "wrote 1, failed 0" in _long_way(cli, build)
    _nothing_to_do(cli, build)


def test_a_failed_sample_a_rebuilt_log_and_a_dead_owner_take_the_long_way(make_build, cli, no_racy_wait):
    rows = random_rows(6, seed=3)
    build = make_build(rows=rows)
    assert cli("run", build, "--no-progress").returncode == 0
    _nothing_to_do(cli, build)

    # a dead owner's lock record: the long way takes the lock over and records who held it
    lock = layout(build).lock
    lock.write_text(json.dumps({"pid": 999999999, "host": os.uname().nodename, "purpose": "run"}).ljust(4096))
    _long_way(cli, build)
    _nothing_to_do(cli, build)

    # the log lost and rebuilt from the data: resumed the long way (it checks what the data holds)
    for p in layout(build).root.glob("events.duckdb*"):
        p.unlink()
    assert cli("rebuild-log", build, "--no-progress").returncode == 0
    assert "wrote 0, failed 0" in _long_way(cli, build)
    _nothing_to_do(cli, build)


def test_a_failed_sample_is_resumed(make_build, cli, no_racy_wait):
    nan = 7  # the built-in model's testing aid: a sample holding this token fails `nonfinite`
    rows = random_rows(4, seed=3)
    rows[1]["input_ids"][0] = nan
    build = make_build(rows=rows, model=f"builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,"
                       f"intermediate=128,nan_token={nan}")
    assert cli("run", build, "--no-progress").returncode == 1
    _long_way(cli, build, code=1)  # retried (attempts left), failed again: exit 1 as before, never "done"


def test_a_complete_build_that_cannot_be_written_is_refused_as_before(tmp_path, cli, no_racy_wait):
    """resume refuses a read-only build (exit 2, "not writable"), nothing to do or not: never "done" instead."""
    with mounted_tmpfs(tmp_path / "mnt", "64m") as mnt:
        src = write_jsonl(mnt / "src.jsonl", random_rows(3))
        build = mnt / "b"
        cli("init", build, "--source", src, "--model", "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,"
            "intermediate=128", "--high", "0.998", "--low", "0.997", "--flood", "0.999", check=True)
        cli("run", build, "--no-progress", check=True)
        assert _runs(build)[-1]["stat"] is not None
        _nothing_to_do(cli, build)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        cp = cli("resume", build, "--no-progress")
        assert cp.returncode == 2 and "not writable" in cp.stderr, cp.stdout + cp.stderr


def test_a_source_modified_just_before_the_run_gets_no_identity(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(2))
    st = os.stat(src)
    newest = max(st.st_mtime_ns, st.st_ctime_ns)
    assert settled.source_stat(src, now_ns=newest + int(settled.RACY_SECONDS * 1e9) - 1) is None
    stat = settled.source_stat(src, now_ns=newest + int(settled.RACY_SECONDS * 1e9))
    assert stat is not None and stat["size"] == st.st_size and stat["ctime_ns"] == st.st_ctime_ns
    assert settled.source_stat(tmp_path, now_ns=newest + 10**12) is None  # not a regular file
    assert settled.source_stat(tmp_path / "missing.jsonl") is None
