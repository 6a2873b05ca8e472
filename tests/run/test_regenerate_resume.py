"""A regenerating build (issue 43) SIGKILLed mid-run, then resumed: every sample written once, a response that was
committed before the kill never generated again (its tokens and states bit-identical afterwards), every written
event (adopted ones too) with its generation's figures; and the whole build equal, token for token, to the same
build run without a kill (the seeds are per sample: sampled responses are reproducible, greedy ones too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import forked
import numpy as np
import pytest
import torch
from conftest import wait_written, write_jsonl

from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset

MODEL = "builtin:hidden=64,layers=4,heads=2,kv_heads=1,intermediate=128"
N = 14


def _rows() -> list[dict]:
    rows = []
    for i in range(N):
        msgs = [{"role": "user", "content": f"question {i}?"}]
        if i % 2:  # two assistant turns: the second generated after the first's regenerated text
            msgs += [{"role": "assistant", "content": "an old answer"}, {"role": "user", "content": "and then?"},
                     {"role": "assistant", "content": "another"}]
        rows.append({"id": f"c{i}", "messages": msgs})
    return rows


def _init(cli, build, src, *more: str) -> None:
    cp = cli("init", build, "--source", src, "--model", MODEL, "--regenerate", "--max-new-tokens", "6",
             "--temperature", "0.8", "--top-p", "0.9", "--seed", "11", "--allow-overcommit", *more)
    assert cp.returncode == 0, cp.stderr


def _stored(build) -> dict[str, tuple[list[int], list[int], bytes, bytes]]:
    return {it["sample_id"]: (it["input_ids"].tolist(), it["loss_mask"].tolist(),
                              it["aux_hidden_state"].view(torch.int16).numpy().tobytes(),
                              it["hidden_state"].view(torch.int16).numpy().tobytes()) for it in HiddenStateDataset(build)}


@pytest.mark.claim("crash")
def test_sigkill_mid_run_then_resume(tmp_path, cli, hold):
    src = write_jsonl(tmp_path / "chats.jsonl", _rows())
    build, ref = tmp_path / "b", tmp_path / "ref"
    _init(cli, build, src)
    _init(cli, ref, src)

    held = hold(7)  # the worker holds at its 7th sample; with groups of one, the 6 before it are durable
    p = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(build), "--no-progress", "--workers", "1",
                      "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                     env={**held.env, "HSBUILD_GROUP_SAMPLES": "1"})
    held.wait(1, proc=p)
    wait_written(build, 3, p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    committed = _stored(build)
    assert 3 <= len(committed) < N

    cp = cli("resume", build, "--no-progress", "--workers", "1", "--device", "cpu")
    assert cp.returncode == 0, cp.stderr
    after = _stored(build)
    assert sorted(after) == sorted(f"c{i}" for i in range(N))
    for sid, sample in committed.items():
        assert after[sid] == sample, f"{sid}: committed before the kill, changed by the resume"
    with EventLog(layout(build).events, read_only=True) as log:
        per_sample = dict(log.query("SELECT sample_id, count(*) FROM events WHERE kind = 'written' GROUP BY 1")[1])
        details = [json.loads(d) for (d,) in log.query("SELECT detail FROM events WHERE kind = 'written'")[1]]
        started = dict(log.query("SELECT sample_id, count(*) FROM events WHERE kind = 'started' GROUP BY 1")[1])
    assert set(per_sample.values()) == {1} and len(per_sample) == N, "a sample was written twice, or not at all"
    assert all(started.get(sid, 0) == 1 for sid in committed if sid in started)  # never started again
    for d in details:  # adopted ones (durable before the kill, their events lost) keep their figures too
        assert d["finish_reason"] in ("stop", "length") and 1 <= d["generated"] <= 6, d
        assert d["turns"] in (1, 2) and isinstance(d["seed"], int), d

    cp = cli("run", ref, "--no-progress", "--workers", "1", "--device", "cpu")
    assert cp.returncode == 0, cp.stderr
    whole = _stored(ref)
    for sid in after:  # the same tokens and mask as a run that was never killed; states too (same kernels)
        assert after[sid][:2] == whole[sid][:2], sid
        assert np.array_equal(np.frombuffer(after[sid][2], np.uint8), np.frombuffer(whole[sid][2], np.uint8)), sid
    two = [it for it in HiddenStateDataset(build) if it["sample_id"] == "c1"][0]
    assert two["loss_mask"].tolist().count(1) > 6  # the regenerated first turn is masked in the final prompt
