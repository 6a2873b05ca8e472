"""`--workers auto`, a new build's default: how many workers a run starts on this host, and why.

The rule itself (auto_workers) is a function of what the host has, tested over hosts this machine is not
(8 GPUs, 64 cores, little memory); the runs below use the real host: its CPU affinity, /proc/meminfo.
There is no GPU here: the GPU count comes from NVML faked at its boundary, narrowed by CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import fake_nvml_module, hsbuild
from vllm_fixture import make_model

from builder.config import BuildConfig
from builder.doctor import gpu
from builder.extract.model import Extractor
from builder.run.sizing import (
    CPU_WORKERS_MAX,
    WORKER_BASE_BYTES,
    Host,
    auto_workers,
    mem_available,
    model_bytes,
    quota_cpus,
    usable_cpus,
    visible_gpus,
    workers_for,
)

GiB = 1 << 30
TINY = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def test_cpu_workers_one_a_core_up_to_the_cap_each_with_its_share_of_threads():
    assert auto_workers("inprocess", "cpu", 10 << 20, Host(cpus=2, mem_available=64 * GiB, gpus=0)).workers == 2
    wide = auto_workers("inprocess", "auto", 10 << 20, Host(cpus=64, mem_available=512 * GiB, gpus=0))
    assert wide.workers == CPU_WORKERS_MAX
    assert f"at most {CPU_WORKERS_MAX}" in wide.why and "8 thread(s) each" in wide.why
    assert auto_workers("inprocess", "cpu", 10 << 20, Host(cpus=1, mem_available=64 * GiB, gpus=0)).workers == 1


def test_cpu_workers_are_as_many_as_half_the_available_memory_holds_copies_of_the_model():
    model = 6 * GiB  # a worker: 6 + 1.5 GiB (a pass's activations) + the process itself
    per = model + model // 4 + WORKER_BASE_BYTES
    host = Host(cpus=16, mem_available=4 * per, gpus=0)  # half of it holds two copies
    count = auto_workers("inprocess", "cpu", model, host)
    assert count.workers == 2
    assert "memory for 2 copies" in count.why and "8 thread(s) each" in count.why
    # too little memory for even one: still one worker (the run then says what the load did)
    short = auto_workers("inprocess", "cpu", model, Host(cpus=16, mem_available=GiB, gpus=0))
    assert short.workers == 1 and "less than one copy" in short.why
    # memory unknown (no /proc/meminfo): the cores decide
    assert auto_workers("inprocess", "cpu", model, Host(cpus=4, mem_available=None, gpus=0)).workers == 4


def test_gpu_workers_one_a_visible_gpu_unless_pinned_or_served():
    host = Host(cpus=96, mem_available=2048 * GiB, gpus=8)
    assert auto_workers("inprocess", "auto", 16 * GiB, host).workers == 8
    assert auto_workers("inprocess", "cuda", 16 * GiB, host).workers == 8
    # each worker loads its copy in host memory before moving it to its GPU: 8 copies of 140 GB do not fit
    # in half of 1 TiB, 2 do
    tight = auto_workers("inprocess", "auto", 140 * GiB, Host(cpus=96, mem_available=1024 * GiB, gpus=8))
    assert tight.workers == 2 and "8 GPUs visible, but memory for 2 copies" in tight.why
    assert auto_workers("inprocess", "auto", 140 * GiB, Host(cpus=96, mem_available=None, gpus=8)).workers == 8
    pinned = auto_workers("inprocess", "cuda:3", 140 * GiB, host)
    assert pinned.workers == 1 and "cuda:3" in pinned.why
    assert auto_workers("vllm", "auto", 0, host).workers == 1
    # --device cpu on a GPU node: the CPU rule
    roomy = Host(cpus=96, mem_available=512 * GiB, gpus=8)
    assert auto_workers("inprocess", "cpu", 10 << 20, roomy).workers == CPU_WORKERS_MAX


def test_a_containers_cpu_quota_bounds_the_cores(tmp_path):
    """cgroup v2's cpu.max, as a container runtime writes it (a directory of files stands in for the mount)."""
    cg = tmp_path / "cgroup"
    cg.mkdir()
    assert quota_cpus(cg) is None and usable_cpus(cg) == usable_cpus(tmp_path / "none")  # no file: no quota
    for text, cpus in (("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000", 1)):
        (cg / "cpu.max").write_text(text)
        assert quota_cpus(cg) == cpus, text
    (cg / "cpu.max").write_text("100000 100000\n")
    assert usable_cpus(cg) == 1  # whatever this machine's affinity mask holds
    (cg / "cpu.max").write_text(f"{1000 * 100000} 100000\n")  # a quota above the mask: the mask
    assert usable_cpus(cg) == len(os.sched_getaffinity(0))


def test_visible_gpus_are_nvmls_narrowed_by_cuda_visible_devices(monkeypatch):
    fake = fake_nvml_module()
    monkeypatch.setattr(gpu, "_nvml", lambda: fake.FakeNVML([fake.FakeGpu() for _ in range(8)]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == 8
    for env, n in (("0,1,2", 3), ("GPU-1234,GPU-5678", 2), ("", 0), ("-1", 0), (",".join(map(str, range(12))), 8)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == n, env
    # no driver (NVML does not load): no GPU, whatever CUDA_VISIBLE_DEVICES says
    monkeypatch.setattr(gpu, "_nvml", lambda: fake.FakeNVML(library_missing=True))
    assert visible_gpus() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == 0


def test_model_bytes_of_the_builtin_model_is_its_parameters_in_the_runs_dtype():
    ex = Extractor("builtin", None, "bfloat16", device="cpu")
    params = sum(p.numel() for p in ex._model.parameters())
    assert model_bytes("builtin", "bfloat16") == 2 * params
    assert model_bytes("builtin", "float32") == 2 * model_bytes("builtin", "bfloat16")


def test_model_bytes_of_a_hugging_face_directory_scales_its_weights_to_the_runs_dtype(tmp_path):
    pytest.importorskip("transformers", reason="needs the [hf] extra")
    model = make_model(tmp_path / "llama")  # saved in float32
    stored = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert json.loads((model / "config.json").read_text()).get("torch_dtype", "float32") == "float32"
    assert model_bytes(str(model), "float32") == stored
    assert model_bytes(str(model), "bfloat16") == stored // 2
    assert model_bytes(str(tmp_path / "nothing-here"), "bfloat16") == 0


def test_a_builds_count_follows_its_backend_device_and_model():
    host = Host(cpus=4, mem_available=64 * GiB, gpus=0)
    cfg = BuildConfig(source="s.jsonl", model=TINY)
    assert workers_for(cfg, host=host).workers == 4
    assert workers_for(cfg, "cuda:1", host=host).workers == 1
    served = BuildConfig(source="s.jsonl", model="/models/llama", backend="vllm")
    assert workers_for(served, host=host).workers == 1
    # an import reads dumped files, whatever the build's backend: no model is loaded
    assert workers_for(served, importing=True, host=host).workers == 4
    # a 70B-shaped model in bf16 (~140 GB) on a 64 GiB host: one worker, and the reason says so
    big = BuildConfig(source="s.jsonl", model="builtin:hidden=8192,layers=80,heads=64,kv_heads=8,intermediate=28672")
    count = workers_for(big, host=host)
    assert count.workers == 1 and "less than one copy" in count.why


def _run_started(build) -> dict:
    cp = hsbuild("sql", build, "SELECT detail FROM events WHERE kind = 'run_started' ORDER BY seq", "--json",
                 check=True)
    return json.loads(json.loads(cp.stdout)[-1]["detail"])


def test_a_new_build_runs_one_worker_a_core_and_says_why(make_build):
    build = make_build(n=12, model=TINY, workers="auto")
    assert 'workers = "auto"' in (build / "hsbuild.toml").read_text()
    avail = mem_available()
    assert avail is None or avail > 4 * GiB, "this test needs the tiny model's workers to fit in memory"
    cp = hsbuild("run", build, "--no-progress", check=True)
    cores = min(usable_cpus(), CPU_WORKERS_MAX)
    assert f"workers: {cores} (auto: the CPU: {usable_cpus()} usable core(s)" in cp.stderr
    started = _run_started(build)
    assert started["workers"] == cores and started["threads"] == usable_cpus() // cores
    assert "usable core(s)" in started["workers_auto"]
    assert "wrote 12, failed 0" in cp.stdout


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_auto_counts_the_cores_the_run_may_use_not_the_machines(make_build):
    build = make_build(n=6, model=TINY, workers="auto")
    cp = hsbuild("run", build, "--no-progress", check=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert "workers: 1 (auto: the CPU: 1 usable core(s); 1 thread(s) each)" in cp.stderr
    assert _run_started(build)["workers"] == 1


def test_a_number_is_taken_as_given_from_the_flag_or_the_config(make_build):
    build = make_build(n=6, model=TINY, workers="auto")
    cp = hsbuild("run", build, "--no-progress", "--workers", "1", "--limit", "3", check=True)
    assert "auto" not in cp.stderr and _run_started(build)["workers"] == 1
    cfg = BuildConfig.from_toml(build / "hsbuild.toml")
    cfg.workers = 1  # as every build made before `auto` recorded it
    cfg.save(build / "hsbuild.toml")
    cp = hsbuild("run", build, "--no-progress", check=True)
    assert "auto" not in cp.stderr and _run_started(build)["workers"] == 1


@pytest.mark.parametrize("value", ['"many"', "0", "2.5", "true"])
def test_a_bad_workers_value_in_the_config_is_refused_naming_the_file_and_key(make_build, value):
    build = make_build(n=4, model=TINY, workers="auto")
    toml = build / "hsbuild.toml"
    toml.write_text(toml.read_text().replace('workers = "auto"', f"workers = {value}"))
    before = (build / "events.duckdb").stat().st_size if (build / "events.duckdb").exists() else None
    cp = hsbuild("run", build, "--no-progress")
    assert cp.returncode == 2, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "hsbuild.toml" in lines[0] and "workers" in lines[0] and "auto" in lines[0]
    if before is not None:
        assert (build / "events.duckdb").stat().st_size == before


@pytest.mark.parametrize("flag", ["0", "many", "-1"])
def test_a_bad_workers_flag_is_a_usage_error(make_build, flag):
    build = make_build(n=4, model=TINY, workers="auto")
    cp = hsbuild("run", build, "--workers", flag)
    assert cp.returncode == 2 and "--workers" in cp.stderr and "auto" in cp.stderr
