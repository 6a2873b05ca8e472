"""Recovering from ordinary mistakes without starting over: a bad row fixed, rows removed or added, samples that
can never succeed skipped, a source file moved. Real builds, the real CLI in subprocesses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import random_rows, write_jsonl
from test_run import assert_bit_exact

from builder.config import BuildConfig
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset

NAN = 7  # the builtin model's testing aid: this token's embedding is NaN, so a sample holding it fails `nonfinite`
MODEL = f"builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128,nan_token={NAN}"


def _rows(n: int = 10) -> list[dict]:
    rows = random_rows(n, seed=3)
    for r in rows:
        r["input_ids"] = [t if t != NAN else NAN + 1 for t in r["input_ids"]]
    return rows


def _log_state(build) -> tuple[int, dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        n = log.query("SELECT count(*) FROM events")[1][0][0]
        return n, {r["sample_id"]: r for r in log.samples()}


def _events(build, kind: str) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts("SELECT * FROM events WHERE kind = ? ORDER BY seq", [kind])


def _source(build):
    return BuildConfig.from_toml(layout(build).config).source


def test_fix_a_bad_row_remove_one_add_one_then_finish_with_exit_0(make_build, cli):
    rows = _rows(10)
    rows[3]["input_ids"][2] = NAN  # a bad row: fails every run
    build = make_build(rows=rows, model=MODEL)
    src = _source(build)
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 1, cp.stderr
    n_before, before = _log_state(build)
    assert before["s0003"]["state"] == "failed" and before["s0003"]["error"] == "nonfinite"
    again = cli("resume", build, "--no-progress")
    assert again.returncode == 1  # without a fix, the build can never finish
    n_before, before = _log_state(build)

    # the user fixes row 3, edits row 1 (already written), deletes row 5 and appends a new row
    fixed = [dict(r) for r in rows]
    fixed[3] = {**rows[3], "input_ids": [t if t != NAN else NAN + 1 for t in rows[3]["input_ids"]]}
    fixed[1] = {**rows[1], "input_ids": rows[1]["input_ids"][:-2], "loss_mask": rows[1]["loss_mask"][:-2]}
    new = _rows(12)[11]
    new["id"] = "s0100"
    fixed = fixed[:5] + fixed[6:] + [new]
    write_jsonl(Path(src), fixed)

    cp = cli("resume", build, "--no-progress")  # refused, and it says what changed and how to accept it
    assert cp.returncode == 2
    first = cp.stderr.strip().splitlines()[0]
    assert "2 changed (s0001, s0003), 1 removed (s0005), 1 added (s0100)" in first, first
    assert "--accept-source-changes" in first
    assert _log_state(build)[0] == n_before  # nothing recorded

    cp = cli("resume", build, "--no-progress", "--accept-source-changes")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "source changes accepted: 2 changed (s0001, s0003), 1 removed (s0005), 1 added (s0100)" in cp.stderr
    _, after = _log_state(build)
    assert after["s0003"]["state"] == "written" and after["s0003"]["attempts"] == 1  # counted from the change
    assert after["s0001"]["state"] == "written" and after["s0001"]["num_tokens"] == len(fixed[1]["input_ids"])
    assert after["s0005"]["state"] == "retired" and after["s0005"]["retired_reason"] == "removed_from_source"
    assert after["s0100"]["state"] == "written"
    # the untouched samples were kept, not extracted again, and their rows follow the edited file
    for sid in ("s0000", "s0002", "s0004", "s0006", "s0009"):
        assert after[sid]["segment"] == before[sid]["segment"] and after[sid]["starts"] == before[sid]["starts"]
    assert {r["sample_id"]: r["row_idx"] for r in after.values() if r["state"] != "retired"} == {
        r["id"]: i for i, r in enumerate(fixed)}
    changes = _events(build, "source_changed")
    assert len(changes) == 1 and json.loads(changes[0]["detail"])["removed"] == ["s0005"]

    # the reader serves exactly the edited source, in its order, each sample the model's output for its new row
    ds = HiddenStateDataset(build)
    assert [ds.index[i]["sample_id"] for i in range(len(ds))] == [r["id"] for r in fixed]
    assert assert_bit_exact(build, model=MODEL) == len(fixed)
    st = cli("status", build, "--json", check=True)
    status = json.loads(st.stdout)
    assert (status["total"], status["done"], status["failed"], status["retired"]) == (10, 10, 0, 1)
    assert cli("resume", build, "--no-progress").returncode == 0  # and it stays accepted


def test_skip_a_sample_that_can_never_succeed(make_build, cli):
    rows = _rows(6)
    rows[2]["input_ids"][0] = NAN
    build = make_build(rows=rows, model=MODEL)
    assert cli("run", build, "--no-progress").returncode == 1
    n, _ = _log_state(build)

    bad = cli("skip", build, "s0002", "nope", "--reason", "NaN")
    assert bad.returncode == 2 and "nope: no such sample id" in bad.stderr.splitlines()[0]
    no_reason = cli("skip", build, "s0002")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    assert _log_state(build)[0] == n  # nothing recorded

    cp = cli("skip", build, "s0002", "--reason", "NaN in the row", check=True)
    assert "skipped 1 sample(s): s0002" in cp.stdout
    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    _, st = _log_state(build)
    assert st["s0002"]["state"] == "retired" and st["s0002"]["retired_note"] == "NaN in the row"
    q = cli("sql", build, "SELECT total, done, failed, retired FROM progress", "--json", check=True)
    assert json.loads(q.stdout) == [{"total": 5, "done": 5, "failed": 0, "retired": 1}]
    assert len(HiddenStateDataset(build)) == 5
    assert "| 1 retired" in cli("status", build, check=True).stdout

    cp = cli("skip", build, "s0002", "--undo", check=True)  # brought back: tried again (and fails again)
    assert "brought back 1 sample(s): s0002" in cp.stdout
    assert cli("resume", build, "--no-progress").returncode == 1
    _, st = _log_state(build)
    assert st["s0002"]["state"] == "failed" and st["s0002"]["attempts"] == 1


def test_a_moved_source_is_repointed(make_build, cli, tmp_path):
    build = make_build(n=8)
    old = _source(build)
    assert cli("run", build, "--no-progress", "--limit", "3").returncode == 0
    moved = tmp_path / "elsewhere" / "source.jsonl"
    moved.parent.mkdir()
    shutil.move(old, moved)
    n, _ = _log_state(build)

    cp = cli("resume", build, "--no-progress")
    assert cp.returncode == 2
    first = cp.stderr.strip().splitlines()[0]
    assert old in first and f"hsbuild resume {build} --source NEWPATH" in first, first
    doc = cli("doctor", build, "--json", "--no-record")
    src_check = next(c for c in json.loads(doc.stdout)["checks"] if c["name"] == "env.source")
    assert src_check["status"] == "fail" and "--source NEWPATH" in src_check["fix"]

    other = write_jsonl(tmp_path / "other.jsonl", random_rows(8, seed=9))
    cp = cli("resume", build, "--no-progress", "--source", other)
    assert cp.returncode == 2 and "does not hold the build's registered samples" in cp.stderr
    missing = cli("resume", build, "--no-progress", "--source", tmp_path / "nope.jsonl")
    assert missing.returncode == 2 and "--source" in missing.stderr.splitlines()[0]
    assert _source(build) == old and _log_state(build)[0] == n  # nothing changed

    cp = cli("resume", build, "--no-progress", "--source", moved)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert _source(build) == str(moved)
    ev = _events(build, "source_moved")
    assert len(ev) == 1 and json.loads(ev[0]["detail"]) == {"previous": old, "source": str(moved)}
    assert _log_state(build)[1]["s0007"]["state"] == "written"
    assert cli("resume", build, "--no-progress").returncode == 0  # later runs read it from its new place
    assert assert_bit_exact(build) == 8
