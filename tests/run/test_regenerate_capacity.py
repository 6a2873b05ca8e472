"""What `status` and the capacity check count for a regenerating build (issue 43, docs/regenerate.md): a stored
sample is its prompt and the generated tokens, but the source registers the first prompt only. So the tokens
written are those stored, each sample not yet generated counts its prompt + --max-new-tokens (an upper bound
with --turns last), and the capacity check a run starts with projects exactly what `status` projects: never
fewer tokens than the build then writes (a check that believes the build smaller than it is lets the disk fill)."""

from __future__ import annotations

import json

from conftest import write_jsonl

from builder.humanize import human_bytes
from builder.layout import layout
from builder.log.events import EventLog

MODEL = "builtin:hidden=64,layers=4,heads=2,kv_heads=1,intermediate=128,vocab=8"
N, MAX_NEW = 8, 12
RUN = ("--no-progress", "--workers", "1", "--device", "cpu")


def _status(cli, build) -> dict:
    cp = cli("status", build, "--json")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def _sql(build, q: str) -> tuple:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query(q)[1][0]


def test_tokens_and_capacity_count_the_responses(tmp_path, cli):
    src = write_jsonl(tmp_path / "chats.jsonl", [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question number {i}, " + "and more " * i}]} for i in range(N)])
    build = tmp_path / "b"
    cp = cli("init", build, "--source", src, "--model", MODEL, "--regenerate", "--max-new-tokens", str(MAX_NEW),
             "--turns", "last", "--temperature", "1.5", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    (prompts,) = _sql(build, "SELECT sum(source_tokens) FROM samples")
    assert f"{prompts + N * MAX_NEW:,} token(s) as stored at most" in cp.stdout

    st = _status(cli, build)  # nothing generated yet: each sample its prompt + max_new_tokens
    assert (st["response_allowance"], st["allowance_basis"]) == (MAX_NEW, "max_new_tokens")
    assert st["tokens_total"] == st["todo_tokens"] == st["remaining_tokens"] == prompts + N * MAX_NEW

    cp = cli("run", build, *RUN, "--limit", "3")
    assert cp.returncode == 0, cp.stderr
    st = _status(cli, build)
    done, grown, todo_prompts = _sql(build, "SELECT sum(num_tokens) FILTER (WHERE state = 'written'), "
                                            "sum(num_tokens - source_tokens) FILTER (WHERE state = 'written'), "
                                            "sum(source_tokens) FILTER (WHERE state = 'pending') FROM samples")
    assert st["tokens_done"] == done and 0 < grown <= 3 * MAX_NEW  # what was stored, responses included
    assert st["tokens_total"] == done + todo_prompts + (N - 3) * MAX_NEW  # (--turns last: grown <= max_new)
    assert st["todo_tokens"] == todo_prompts + (N - 3) * MAX_NEW
    bound = st["tokens_total"]
    text = cli("status", build).stdout
    assert f"tokens:  {done:,} of about {bound:,}" in text and f"first prompt + {MAX_NEW} tokens" in text

    cp = cli("resume", build, *RUN)
    assert cp.returncode == 0, cp.stderr
    # the run's capacity check projected what status did, responses included
    assert f"capacity: {human_bytes(st['projected_bytes'])} more projected" in cp.stderr, cp.stderr
    st = _status(cli, build)
    assert st["done"] == N and st["tokens_total"] == st["tokens_done"] <= bound  # the bound held
    assert st["tokens_done"] > prompts  # (what main counted as the whole build)
