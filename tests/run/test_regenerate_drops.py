"""A regenerating build's dropped responses (--drop-truncated, issue 43) are kept beside the data, in `drop`
history records written before their `retired` events commit (docs/design.md section 11): so a log rebuilt from
the data gives back exactly what the lost log said of every sample (state, retired reason and note, finish
reason, tokens generated), status counts the same, the chat export is the same; and a run SIGKILLed between a
drop's record and its events leaves the record, which the next run takes as it is: those samples retired,
never generated again, the build the same as one never killed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import forked
import pytest
from conftest import write_jsonl

from builder.layout import layout
from builder.log.events import EventLog
from builder.run.testhook import KILL_ENV
from builder.store.history import read_history

MODEL = "builtin:hidden=64,layers=4,heads=2,kv_heads=1,intermediate=128,vocab=8"
N = 12
RUN = ("--no-progress", "--workers", "1", "--device", "cpu")
# what a user reads of each sample, and relies on being the same after rebuild-log
VIEW = ("SELECT sample_id, state, retired_reason, retired_note, finish_reason, generated, num_tokens, disk_bytes, "
        "segment, token_start, checksums FROM samples ORDER BY sample_id")
STATUS_KEYS = ("total", "done", "written", "failed", "pending", "retired", "tokens_done", "tokens_total",
               "at_token_limit", "dropped_at_token_limit", "disk_bytes_done", "todo_tokens", "response_allowance")


def _rows() -> list[dict]:
    rows = []
    for i in range(N):
        msgs = [{"role": "user", "content": f"question {i}?"}]
        if i % 3 == 1:  # two assistant turns
            msgs += [{"role": "assistant", "content": "old"}, {"role": "user", "content": "and?"},
                     {"role": "assistant", "content": "another"}]
        rows.append({"id": f"c{i:02d}", "messages": msgs})
    return rows


def _init(cli, build, src) -> None:
    # sampled over the built-in model's random head of 8 tokens: a response of 4 meets its EOS now and then, so the
    # build holds both kinds (seeded: the same responses every time)
    cp = cli("init", build, "--source", src, "--model", MODEL, "--regenerate", "--max-new-tokens", "4",
             "--temperature", "1.5", "--seed", "3", "--drop-truncated", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr


def _view(build) -> list[tuple]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query(VIEW)[1]


def _sql(build, q: str) -> tuple:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query(q)[1][0]


def _status(cli, build) -> dict:
    cp = cli("status", build, "--json")
    assert cp.returncode == 0, cp.stderr
    st = json.loads(cp.stdout)
    return {k: st[k] for k in STATUS_KEYS}


def _export(cli, build, out) -> list[str]:
    cp = cli("export", build, out, "--format", "chat", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    return sorted(line for p in sorted(out.rglob("*.jsonl")) for line in p.read_text().splitlines())


def test_rebuild_log_keeps_the_drops(tmp_path, cli):
    src = write_jsonl(tmp_path / "chats.jsonl", _rows())
    build = tmp_path / "b"
    _init(cli, build, src)
    cp = cli("run", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    before = _view(build)
    states = {r[1] + ":" + str(r[2]) for r in before}
    assert states == {"written:None", "retired:at_token_limit"}, states  # (the build holds both kinds)
    status = _status(cli, build)
    assert status["dropped_at_token_limit"] == sum(r[2] == "at_token_limit" for r in before) > 0
    # (--turns all: the written two-turn conversations grew by more than --max-new-tokens, so the allowance for a
    # sample not yet generated is the measured mean growth)
    grown, n = _sql(build, "SELECT sum(num_tokens - source_tokens), count(*) FROM samples WHERE state = 'written'")
    assert grown / n > 4 and status["response_allowance"] == math.ceil(grown / n)
    chat = _export(cli, build, tmp_path / "chat-before")
    assert len(chat) == sum(r[1] == "written" for r in before)  # (one conversation a kept sample)

    lay = layout(build)
    lay.events.unlink()
    lay.wal.unlink(missing_ok=True)
    cp = cli("rebuild-log", build)
    assert cp.returncode == 0, cp.stderr
    assert _view(build) == before  # (today's main: the dropped ones came back pending)
    assert f"{status['dropped_at_token_limit']} dropped at the token limit" in cp.stdout
    assert _status(cli, build) == status
    assert _export(cli, build, tmp_path / "chat-after") == chat
    recs = [r for r in read_history(lay.data) if r.kind == "drop"]  # (what it was rebuilt from)
    assert sorted(x["sample_id"] for r in recs for x in r.body["samples"]) == sorted(
        r[0] for r in before if r[2] == "at_token_limit")

    # and nothing is generated again: the dropped responses stay retired
    cp = cli("resume", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    with EventLog(lay.events, read_only=True) as log:
        assert log.query("SELECT count(*) FROM events WHERE kind = 'started'")[1][0][0] == 0
    assert _view(build) == before

    # `skip --undo` of a dropped sample says why it cannot come back (it said "removed from the source")
    dropped = next(r[0] for r in before if r[2] == "at_token_limit")
    log_before = lay.events.read_bytes()
    cp = cli("skip", build, dropped, "--undo")
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1
    assert dropped in cp.stderr and "--drop-truncated" in cp.stderr and "removed from the source" not in cp.stderr
    assert lay.events.read_bytes() == log_before

    # a damaged drop record is refused, naming it and what is lost without it, before anything changes
    damaged = lay.data / "history" / recs[0].name
    damaged.write_bytes(b"\x00" * 40)
    log_before = lay.events.read_bytes()
    cp = cli("rebuild-log", build)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and str(damaged) in cp.stderr
    assert "come back pending" in cp.stderr
    assert lay.events.read_bytes() == log_before


@pytest.mark.claim("crash")
def test_sigkill_between_the_drop_record_and_its_events(tmp_path, cli):
    src = write_jsonl(tmp_path / "chats.jsonl", _rows())
    build, ref = tmp_path / "b", tmp_path / "ref"
    _init(cli, build, src)
    _init(cli, ref, src)
    cp = cli("run", ref, *RUN)
    assert cp.returncode == 0, cp.stderr
    whole = _view(ref)

    # the run kills itself once its first drop record is durable, before that record's events are emitted
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), *RUN], stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE, text=True, env={**os.environ, KILL_ENV: "drop"})
    _, err = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL, err
    recs = read_history(layout(build).data, ("drop",))
    assert len(recs) == 1
    dropped = {x["sample_id"] for x in recs[0].body["samples"]}
    with EventLog(layout(build).events, read_only=True) as log:
        retired = log.query("SELECT count(*) FROM samples WHERE state = 'retired'")[1][0][0]
    assert dropped and retired == 0  # the record is durable, the log never got its events

    cp = cli("resume", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    assert f"{len(dropped)} dropped response(s)" in cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        run_id = log.query("SELECT run_id FROM events WHERE kind = 'run_started' ORDER BY seq DESC LIMIT 1")[1][0][0]
        again = {r[0] for r in log.query("SELECT sample_id FROM events WHERE kind = 'started' AND run_id = ?",
                                         [run_id])[1]}
        adopted = {r[0] for r in log.query("SELECT sample_id FROM events WHERE kind = 'retired' AND "
                                           "json_extract(detail, '$.adopted')::BOOLEAN")[1]}
    assert adopted == dropped and not again & dropped  # retired from the record, never generated again
    # the same as the build never killed (the seeds are per sample), locations aside; a sample durable before the
    # kill whose event was lost is adopted (read back: `verified`)
    def same(rows: list[tuple]) -> list[tuple]:
        return [(r[0], "written" if r[1] == "verified" else r[1], *r[2:7]) for r in rows]

    assert same(_view(build)) == same(whole)


def test_a_drop_record_that_cannot_be_written(tmp_path, cli):
    """Where the record cannot be written (here data/history/ is a file, not a folder: every response is dropped,
    so the run writes no segment and needs no record of its own), the drops are not retired: the run says so, the
    samples stay in flight, and the next run generates them again and records them."""
    src = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"d{i}", "messages": [
        {"role": "user", "content": f"question {i}?"}]} for i in range(4)])
    build = tmp_path / "b"
    cp = cli("init", build, "--source", src, "--model", MODEL.removesuffix(",vocab=8"), "--regenerate",
             "--max-new-tokens", "1", "--drop-truncated", "--allow-overcommit")  # (one token: never the EOS)
    assert cp.returncode == 0, cp.stderr
    hist = layout(build).data / "history"
    assert not hist.exists()
    hist.write_bytes(b"")
    cp = cli("run", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    assert "4 dropped response(s) (--drop-truncated) not recorded yet" in cp.stderr
    assert "left for the next run, which generates them again" in cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        states = dict(log.query("SELECT state, count(*) FROM samples GROUP BY 1")[1])
    assert states == {"started": 4}  # never retired without its record

    hist.unlink()
    cp = cli("resume", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    assert "4 regenerated response(s) stopped at the token limit" in cp.stderr
    recs = read_history(layout(build).data, ("drop",))
    with EventLog(layout(build).events, read_only=True) as log:
        rows = log.query("SELECT sample_id, state, retired_reason FROM samples ORDER BY 1")[1]
        named = {r[0] for r in log.query("SELECT json_extract_string(detail, '$.record') FROM events "
                                         "WHERE kind = 'retired'")[1]}
    assert rows == [(f"d{i}", "retired", "at_token_limit") for i in range(4)]
    assert named == {r.name for r in recs} and len(recs) == 1
