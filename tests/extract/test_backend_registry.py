"""The backend registry (builder/extract/backends/registry.py): every backend module declares its spec, the
specs are read without torch, and what the CLI, init and the sizing do per backend comes from the spec."""

from __future__ import annotations

import subprocess
import sys

import pytest

from builder.cli.app import build_parser
from builder.config import BuildConfig
from builder.errors import UsageError
from builder.extract.backends import registry
from builder.extract.backends.registry import BackendSpec
from builder.extract.backends.serving import ServerEngine
from builder.run.sizing import Host, auto_workers, workers_for


def test_the_backends_and_what_they_declare():
    assert registry.names() == ["inprocess", "vllm"]  # what a build may name; the import backend is a run's own
    assert registry.importer().name == "import" and not registry.get("import").selectable
    inproc, vllm = registry.get("inprocess"), registry.get("vllm")
    assert inproc.loads_model and not inproc.server and inproc.device is None and inproc.final_state is None
    assert vllm.server and not vllm.loads_model and vllm.device == "cpu" and vllm.final_state == "pre_norm"
    assert isinstance(vllm.server, ServerEngine) and inproc.server is None
    assert vllm.setting(BuildConfig(source="s", backend="vllm"), "inflight") == 16
    assert vllm.setting(BuildConfig(source="s", backend="vllm", inflight=4), "inflight") == 4
    for spec in registry.specs():  # each module declares exactly the spec it registers
        assert spec is sys.modules[spec.open.__module__].BACKEND


def test_the_specs_are_read_without_torch_or_numpy():
    """init and the CLI ask the specs: reading them imports no backend's heavy dependencies."""
    code = ("import sys; from builder.extract.backends import registry; "
            "print([s.name for s in registry.specs()], 'torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['import',", "'inprocess',", "'vllm']", "False", "False"]


def test_unknown_names_and_foreign_flags_are_refused_in_one_line():
    with pytest.raises(UsageError, match=r"^--backend sglang: use one of inprocess, vllm$"):
        registry.choose("sglang")
    with pytest.raises(UsageError, match="use one of inprocess, vllm"):
        registry.choose("import")  # not a build's backend
    with pytest.raises(UsageError, match=r"^b/hsbuild.toml: backend = 'nope': use one of inprocess, vllm$"):
        registry.of_config(BuildConfig(source="s", backend="nope"), "b/hsbuild.toml")
    with pytest.raises(UsageError, match=r"^--batch-tokens 512: only for --backend inprocess"):
        registry.check_options(registry.get("vllm"), {"batch_tokens": 512})
    with pytest.raises(UsageError, match=r"^--server http://h:1: only for --backend vllm"):
        registry.check_options(registry.get("inprocess"), {"server": "http://h:1"})
    registry.check_options(registry.get("inprocess"), {"server": None, "batch_tokens": 64})


def test_a_new_backend_is_its_spec(monkeypatch):
    """Registered, a backend is a --backend choice, and the sizing follows what its spec says (no name known
    anywhere else)."""
    spec = BackendSpec(name="sglang", summary="an SGLang server runs the model", open=lambda s, r: (None, None),
                       server=ServerEngine(), device="cpu", final_state="pre_norm", options={"server": None})
    monkeypatch.setitem(registry._SPECS, "sglang", spec)  # noqa: SLF001
    assert registry.names() == ["inprocess", "sglang", "vllm"] and registry.with_server() == ["sglang", "vllm"]
    args = build_parser().parse_args(["init", "b", "--source", "s.jsonl", "--backend", "sglang"])
    assert args.backend == "sglang"
    host = Host(cpus=8, mem_available=64 << 30, gpus=4)
    assert auto_workers("sglang", "auto", 0, host).workers == 1
    assert workers_for(BuildConfig(source="s", backend="sglang"), host=host).workers == 1
    with pytest.raises(UsageError, match=r"--batch-tokens 8: only for --backend inprocess"):
        registry.check_options(spec, {"batch_tokens": 8})
