"""A storage stall during a vLLM build (issue 30): the build's volume stops answering writes (../shared/powercut,
`stall`) while the engine goes on. No new work goes to the engine, so its staging folder stays bounded (at most
the requests in flight); `status` names the stall within 2 s; after `thaw` the run finishes, every sample once.

Deterministic: the worker is held by the test hook (builder/run/testhook.py) before its 6th task; the volume is
stalled before it is let go, so the stall lands mid-run however fast the server answers."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import Hold, random_rows, write_jsonl
from test_vllm import _one_written_each
from vllm_fixture import VOCAB, needs_vllm

from builder.layout import layout
from builder.log.query import status_snapshot
from builder.run.create import init_build

pytestmark = [pytest.mark.slow, needs_vllm]

RUN_ARGS = ["--no-progress", "--low", "0.999", "--high", "0.999", "--flood", "0.9999"]
INFLIGHT = 4
N = 40


def test_a_stall_during_a_vllm_run_sends_no_new_work_and_staging_stays_bounded(powercut, tmp_path, vllm_server):
    fs = powercut(threads=True)
    src = write_jsonl(tmp_path / "s.jsonl", random_rows(N, 11, vocab=VOCAB, hi=60))
    build = init_build(fs.path("b"), src, model=str(vllm_server.model), backend="vllm", server=vllm_server.url,
                       staging=str(vllm_server.staging), inflight=INFLIGHT).root
    hold = Hold(tmp_path / "hold", 6)
    p = fs.popen(["run", "b", *RUN_ARGS], env={**hold.env, "HSBUILD_STALL_S": "2", "HSBUILD_GROUP_SAMPLES": "1"})
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(iter(p.stderr.readline, "")), daemon=True).start()
    staged: list[int] = []
    answers: list[tuple[float, dict | None]] = []
    try:
        hold.wait(1, p)
        fs.stall()
        hold.release()
        deadline = time.monotonic() + 60
        while not any("STALLED:" in ln for ln in list(err)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("STALLED:" in ln for ln in err), "".join(err)
        for _ in range(15):  # 15 s into the stall
            staged.append(len(list(vllm_server.staging.rglob("*.safetensors"))))
            t0 = time.monotonic()
            st = status_snapshot(layout(build))
            answers.append((time.monotonic() - t0, st.get("stalled")))
            time.sleep(1)
        assert p.poll() is None, "the run ended during the stall"
    finally:
        fs.thaw()
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, "".join(err)[-3000:]
    assert max(staged) <= INFLIGHT, staged  # no more than the requests in flight when it stalled
    assert staged[-1] <= staged[5], staged  # and no new ones once it was stalled
    assert max(t for t, _ in answers) < 2.0 and all(s for _, s in answers), answers
    _one_written_each(build, N)
    assert not list(vllm_server.staging.rglob("*.safetensors"))
