"""Issue 30, point 3: a run's numbers. After a run, `runs` (the view) and `status` give its duration and its
throughput (samples/s, tokens/s, MB/s) from the events; third-party progress bars (transformers' "Loading weights")
stay out of hsbuild's output. A real run of a real build, through the CLI."""

from __future__ import annotations

import json

import pytest
from conftest import write_jsonl

from builder.layout import layout
from builder.log.events import EventLog


def test_runs_and_status_give_duration_and_throughput(make_build, cli):
    build = make_build(12, seed=3)
    cp = cli("run", build, "--no-progress")
    assert cp.returncode == 0, cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        [run] = log.query_dicts("SELECT * FROM runs")
        span = log.query("SELECT epoch(max(ts) FILTER (WHERE kind = 'run_finished')) - "
                         "epoch(min(ts) FILTER (WHERE kind = 'run_started')) FROM events")[1][0][0]
        # no pause: the time spent extracting is from the first sample started to the last one written
        active = log.query("SELECT epoch(max(ts) FILTER (WHERE kind = 'written')) - "
                           "epoch(min(ts) FILTER (WHERE kind = 'started')) FROM events")[1][0][0]
        tokens, nbytes = log.query("SELECT sum(num_tokens), sum(nbytes) FROM events WHERE kind = 'written'")[1][0]
    assert run["written"] == 12 and run["tokens"] == tokens and run["nbytes"] == nbytes
    assert run["duration_s"] == pytest.approx(span, abs=0.002) and run["duration_s"] > 0
    assert run["active_s"] == pytest.approx(active, abs=0.002) and run["active_s"] < run["duration_s"]
    if active > 0:
        assert run["samples_per_s"] == pytest.approx(12 / active, rel=1e-3)
        assert run["tokens_per_s"] == pytest.approx(tokens / active, rel=1e-3)
        assert run["mb_per_s"] == pytest.approx(nbytes / 1e6 / active, rel=1e-2, abs=1e-3)  # (rounded: 3 decimals)
    else:  # every sample started and written within one commit of the log (its times are the commits'): no rate
        assert run["samples_per_s"] is None and run["tokens_per_s"] is None

    st = json.loads(cli("status", build, "--json").stdout)
    assert st["last_run"]["run_id"] == run["run_id"] and st["last_run"]["samples_per_s"] == run["samples_per_s"]
    text = cli("status", build).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("run:"))
    assert "last run (completed)" in line and "12 written" in line and f"{run['duration_s']:.1f} s (wall)" in line
    if active > 0:
        assert "samples/s" in line and "MB/s" in line and f"over {run['active_s']:.1f} s extracting" in line, line
    else:
        assert "too fast to time" in line, line


def test_no_third_party_progress_bars_in_a_run(tmp_path, cli):
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from vllm_fixture import make_model

    model = make_model(tmp_path / "model")
    src = write_jsonl(tmp_path / "s.jsonl", [{"id": f"s{i}", "input_ids": [5 + i, 6, 7, 8]} for i in range(3)])
    cp = cli("init", tmp_path / "b", "--source", src, "--model", model, "--aux-layers", "1,2,3", "--high", "0.998",
             "--low", "0.997", "--flood", "0.999")
    assert cp.returncode == 0, cp.stderr
    cp = cli("run", tmp_path / "b", "--no-progress", "--device", "cpu", "--workers", "2")
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout + cp.stderr
    assert "Loading weights" not in out and "it/s]" not in out and "\r" not in out, out


def test_init_says_how_many_samples_and_tokens_it_found(tmp_path, cli):
    rows = [{"id": f"s{i}", "input_ids": list(range(1, 2 + i))} for i in range(7)]  # 1..7 tokens: 28 in all
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    cp = cli("init", tmp_path / "b", "--source", src, "--max-tokens", "5", "--high", "0.998", "--low", "0.997",
             "--flood", "0.999")
    assert cp.returncode == 0, cp.stderr
    assert ("source: 7 sample(s), 25 token(s) as stored: 2 longer than --max-tokens 5 (the longest: s6, 7 tokens) "
            "are cut to it") in cp.stdout, cp.stdout  # 1+..+5+5+5
