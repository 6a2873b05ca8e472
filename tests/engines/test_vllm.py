"""Extraction through a real vLLM server (CPU build) on real builds: the states match a transformers forward of
the same model (layer ids exact, values within bf16 tolerance), a SIGKILLed hsbuild resumes with every sample
exactly once, and a response that does not match its request fails the sample (`token_mismatch`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import POLL_OWNER_S, hsbuild, random_rows, write_jsonl, written_count
from vllm_fixture import NUM_LAYERS, VOCAB, hsbuild_cmd, needs_vllm, relative_diff, transformers_forward

from builder.extract.backends.base import Failure, Request
from builder.extract.backends.http_client import complete, served_model
from builder.extract.backends.staging import read_and_remove, staging_name
from builder.extract.backends.vllm.backend import VllmBackend, VllmSettings
from builder.extract.final_norm import FinalNorm
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.create import init_build

pytestmark = [pytest.mark.slow, needs_vllm]


def _init(tmp_path: Path, server, n: int, seed: int = 0, name: str = "b", **kw) -> Path:
    src = write_jsonl(tmp_path / f"{name}.jsonl", random_rows(n, seed, vocab=VOCAB, hi=kw.pop("hi", 120)))
    return init_build(tmp_path / name, src, model=str(server.model), backend="vllm", server=server.url,
                      staging=str(server.staging), **kw).root


def _check_against_transformers(build: Path, model_dir: Path, final_state: str) -> int:
    forward = transformers_forward(model_dir)
    ds = HiddenStateDataset(build)
    aux_layers = [1, 2, 3]
    for item in ds:
        hs, pre = forward(item["input_ids"])
        aux = item["aux_hidden_state"].view(len(item["input_ids"]), len(aux_layers), -1)
        for slot, k in enumerate(aux_layers):
            right = relative_diff(aux[:, slot], hs[k])
            assert right < 0.02, (item["sample_id"], k, right)
            # the layer indexing is exact: the neighbouring index is far off
            for other in (k - 1, k + 1):
                assert relative_diff(aux[:, slot], hs[other]) > 10 * right + 0.05, (item["sample_id"], k, other)
        ref_final = hs[NUM_LAYERS] if final_state == "post_norm" else pre
        other_final = pre if final_state == "post_norm" else hs[NUM_LAYERS]
        assert relative_diff(item["hidden_state"], ref_final) < 0.03, item["sample_id"]
        assert relative_diff(item["hidden_state"], other_final) > 0.1, item["sample_id"]
    return len(ds)


def _one_written_each(build: Path, n: int) -> None:
    with EventLog(layout(build).events, read_only=True) as log:
        rows = log.samples()
        per = dict(log.query("SELECT sample_id, count(*) FROM events WHERE kind='written' GROUP BY 1")[1])
    assert len(rows) == n and {r["state"] for r in rows} <= {"written", "verified"}
    assert set(per.values()) == {1}, "a sample was committed twice"


def test_build_through_vllm_matches_transformers(tmp_path, vllm_server):
    build = _init(tmp_path, vllm_server, 24, final_state="post_norm")  # the norm applied to the engine's state
    cp = hsbuild("run", build, "--no-progress", "--inflight", "6", timeout=600)
    assert cp.returncode == 0, cp.stderr
    assert _check_against_transformers(build, vllm_server.model, "post_norm") == 24
    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
        probes = log.query("SELECT detail FROM events WHERE kind = 'engine_probe'")[1]
    assert meta["backend"] == "vllm" and meta["final_state"] == "post_norm"
    assert meta["engine_layer_ids"] == [1, 2, 3, 4]
    assert meta["layer_ids"]["decoder_layer_output"] == [0, 1, 2, 3]
    assert len(probes) == 1 and json.loads(probes[0][0])["layers"] == 4
    assert not list(vllm_server.staging.rglob("*.safetensors")), "staging files left behind"
    assert hsbuild("verify", build).returncode == 0
    # the norm kept in the build derives the other convention from what is stored
    norm = FinalNorm.load(layout(build).final_norm)
    assert norm.eps == pytest.approx(1e-6) and norm.weight.shape == (128,)


def test_pre_norm_build_stores_the_engines_final_state(tmp_path, vllm_server):
    build = _init(tmp_path, vllm_server, 8, seed=3, final_state="pre_norm")
    cp = hsbuild("run", build, "--no-progress", timeout=600)
    assert cp.returncode == 0, cp.stderr
    assert _check_against_transformers(build, vllm_server.model, "pre_norm") == 8


def test_resume_against_another_layer_set_is_refused(tmp_path, vllm_server):
    """The server returns ids 1..4; a build that needs 5 slots (aux 0,1,2,3 + final) is refused in one line."""
    build = _init(tmp_path, vllm_server, 4, aux_layers=[0, 1, 2, 3])
    cp = hsbuild("run", build, "--no-progress", timeout=600)
    assert cp.returncode == 4, cp.stderr
    assert "serves layer ids [1, 2, 3, 4], the build's are [0, 1, 2, 3, 4]" in cp.stderr
    assert "serve-command" in cp.stderr and "Traceback" not in cp.stderr
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.count("written") == 0


@pytest.mark.claim("crash")
def test_sigkill_of_hsbuild_then_resume_through_vllm(tmp_path, vllm_server, hold):
    # Each resume is held by the test hook at a random task (10 to 20) of its worker and never let go: it is
    # killed at a random moment before it gets there, or held there, never after its end, whatever its speed. (By
    # its 10th task, with 8 in flight and groups of one, the worker has taken back and written at least one.)
    n = 200
    build = _init(tmp_path, vllm_server, n, seed=11)
    rng = random.Random(5)
    kills = mid_run = 0
    for i in range(8):
        before = written_count(build)
        held = hold(rng.randint(10, 20))
        p = forked.Popen(hsbuild_cmd("resume", build, "--no-progress", "--inflight", "8"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**held.env, "HSBUILD_GROUP_SAMPLES": "1"})
        if i % 3 == 0:  # any moment, start-up and probe included
            time.sleep(rng.uniform(0.5, 4.0))
        else:  # once this run is writing, a random moment later
            deadline = time.monotonic() + 120
            while p.poll() is None and time.monotonic() < deadline and written_count(build) <= max(before, 0):
                time.sleep(POLL_OWNER_S)
            time.sleep(rng.uniform(0.0, 0.8))
        assert p.poll() is None, f"resume {i} ended (exit {p.returncode}) before its kill"
        during = written_count(build)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        kills += 1
        mid_run += during > max(before, 0)
    assert kills == 8 and mid_run >= 5, f"{kills} kills, {mid_run} mid-run"
    cp = hsbuild("resume", build, "--no-progress", timeout=900)
    assert cp.returncode == 0, cp.stderr
    _one_written_each(build, n)
    assert hsbuild("verify", build).returncode == 0
    assert len(list(vllm_server.staging.rglob("*.safetensors"))) == 0
    # the killed runs' subfolder of the staging folder: removed by the run that finished the build
    with EventLog(layout(build).events, read_only=True) as log:
        assert not (vllm_server.staging / staging_name(log.meta())).exists(), os.listdir(vllm_server.staging)


def test_a_response_for_other_tokens_fails_token_mismatch(tmp_path, vllm_server):
    """A real staging file from the real server, delivered for a request with other tokens."""
    model_id = served_model(vllm_server.url).id
    settings = VllmSettings(server=vllm_server.url, model_name=model_id, staging=str(vllm_server.staging),
                            aux_layers=[1, 2, 3], num_layers=NUM_LAYERS, hidden_size=128, dtype="bfloat16",
                            final_state="pre_norm", inflight=1)
    backend = VllmBackend(settings, None)
    try:
        doc = complete(vllm_server.url, model_id, [5, 6, 7, 8], 120)
        path = doc["kv_transfer_params"]["hidden_states_path"]
        data = read_and_remove(path, 60)
        out = backend._validate(Request("x", np.array([5, 6, 9, 8])), [5, 6, 9, 8], data)
        assert isinstance(out, Failure) and out.reason == "token_mismatch" and "position 2" in out.message
        ok = backend._validate(Request("x", np.array([5, 6, 7, 8])), [5, 6, 7, 8], data)
        assert not isinstance(ok, Failure)
    finally:
        backend.close()


def test_doctor_checks_the_server(tmp_path, vllm_server):
    good = _init(tmp_path, vllm_server, 2, name="good")
    bad = _init(tmp_path, vllm_server, 2, name="bad", aux_layers=[0, 1, 2, 3])
    checks = {}
    for name, b in (("good", good), ("bad", bad)):
        cp = hsbuild("doctor", b, "--json")
        doc = json.loads(cp.stdout)
        checks[name] = next(c for c in doc["checks"] if c["name"] == "env.server")
    assert checks["good"]["status"] == "ok" and checks["good"]["data"]["layers"] == 4
    assert str(vllm_server.model) in checks["good"]["summary"]
    assert checks["bad"]["status"] == "fail"
    assert "serves layer ids [1, 2, 3, 4], the build's are [0, 1, 2, 3, 4]" in checks["bad"]["summary"]
    assert not list(vllm_server.staging.rglob("*.safetensors")), "the probe left its staging file"


def test_doctor_names_another_process_holding_the_gpus(tmp_path, vllm_server, monkeypatch):
    """No GPU here: NVML is faked at its boundary (tests/doctor/fake_nvml.py) and reports the real server's
    processes plus a real foreign process on the GPUs; /proc (who listens on the server's port, parents,
    command lines) is real. Only the foreign one is named, with the command that stops it."""
    from conftest import fake_nvml_module

    from builder.doctor import gpu, procinfo
    from builder.procfs import listening_pids

    fake = fake_nvml_module()
    port = int(vllm_server.url.rsplit(":", 1)[1])
    server_pids = listening_pids(port)
    assert server_pids, "the server's listening process was not found"
    engine_children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                       and procinfo.is_ours(int(p.name), server_pids) and int(p.name) not in server_pids]
    # the rogue must not descend from this process (doctor runs in it here, and its descendants are "ours")
    rogue_pid = int(subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                   text=True, check=True).stdout)
    try:
        held = [fake.FakeGpu(used=70 * fake.GiB, procs=[(pid, 60 * fake.GiB, "python3")])
                for pid in [*server_pids, *engine_children][:2]]
        monkeypatch.setattr(gpu, "_nvml", lambda: fake.FakeNVML(held))
        build = _init(tmp_path, vllm_server, 2)
        server = _doctor_in_process(build)
        assert server["status"] == "ok", server  # the server's own processes are not "another process"
        held.append(fake.FakeGpu(used=40 * fake.GiB, procs=[(rogue_pid, 40 * fake.GiB, "/usr/bin/sleep")]))
        server = _doctor_in_process(build)
        assert server["status"] == "warn" and f"pid {rogue_pid}" in server["summary"], server
        assert server["fix"] == f"kill {rogue_pid}"
    finally:
        os.kill(rogue_pid, signal.SIGKILL)


def _doctor_in_process(build: Path) -> dict:
    """`hsbuild doctor BUILD --json` through the CLI's main in this process (where NVML is faked)."""
    import io

    from builder.cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["doctor", str(build), "--json"])
    return next(c for c in json.loads(out.getvalue())["checks"] if c["name"] == "env.server")


def _transformers_signature(model_dir: Path, vocab: int) -> list[list[float]]:
    """The probe signature (per token, per returned layer id: the state's L2 norm) computed by transformers."""
    from builder.extract.backends.vllm.probe import probe_ids

    forward = transformers_forward(model_dir)
    hs, pre = forward(torch.tensor(probe_ids(vocab)))
    slots = [hs[1], hs[2], hs[3], pre]  # engine ids 1, 2, 3 and 4 (pre-norm)
    return torch.stack([torch.linalg.vector_norm(s.float(), dim=-1) for s in slots], dim=1).tolist()


def test_a_server_serving_another_model_is_refused(tmp_path, vllm_server, tiny_llama):
    """The probe against the build's first probe: the same model (computed by transformers here) passes, another
    model with the same shape (other weights) is refused in one line naming serve-command."""
    from builder.config import load_config
    from builder.run.server_lifecycle import Engine, EngineError, EngineOptions

    build = _init(tmp_path, vllm_server, 2)
    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
    engine = Engine(layout(build), load_config(layout(build)), meta, EngineOptions(), lambda _m: None)
    same = engine.check({"signature": _transformers_signature(tiny_llama, VOCAB)})
    assert same["layers"] == 4
    import transformers

    other_dir = tmp_path / "other"
    torch.manual_seed(123)
    cfg = transformers.AutoConfig.from_pretrained(str(tiny_llama))
    transformers.LlamaForCausalLM(cfg).save_pretrained(other_dir)
    with pytest.raises(EngineError, match="another model or other layers.*serve-command"):
        engine.check({"signature": _transformers_signature(other_dir, VOCAB)})
