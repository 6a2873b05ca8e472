"""Issue 28, point 6: paths are absolute, and local means local.

`init` records every path it is given as the absolute path it named (a build made from one directory runs from any
other, and never picks up another directory's `models/A`); a local Hugging Face directory is read with the hub
switched off: a missing tokenizer or config fails at once, in one line, without a single connection to the hub
(HF_ENDPOINT points at a listener here that records every connection)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import random_rows, write_jsonl

from builder.errors import EXIT_USAGE
from builder.layout import layout
from builder.log.events import EventLog

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
torch = pytest.importorskip("torch")

from vllm_fixture import VOCAB, make_model  # noqa: E402 - (imports transformers' tokenizers when called)

WM = ("--high", "0.998", "--low", "0.997", "--flood", "0.999")
PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
           "no_proxy")


class HubTrap:
    """A TCP listener on 127.0.0.1 that records every connection made to it (and answers none)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(1)
                try:
                    first = conn.recv(200)
                except OSError:
                    first = b""
                self.connections.append(first or b"(connected, sent nothing)")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The hub is the listener, nothing is cached, and nothing but hsbuild's own code keeps it offline."""
    trap = HubTrap()
    monkeypatch.setenv("HF_ENDPOINT", trap.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for k in PROXIES:
        monkeypatch.delenv(k, raising=False)
    yield trap
    trap.close()


def one_line_error(cp, cmd: str) -> str:
    err = cp.stderr.strip()
    assert err.startswith(f"hsbuild {cmd}: error:") and "\n" not in err and "Traceback" not in err, cp.stderr
    return err


def other_model(path: Path) -> Path:
    """A model of the same shape as make_model's, with other weights and the same tokenizer."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def text_rows(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"id": f"t{i}", "text": " ".join(f"w{w}" for w in rng.integers(3, VOCAB, size=int(rng.integers(4, 12))))}
            for i in range(n)]


def test_a_relative_model_path_is_recorded_absolute_and_never_resolved_again(tmp_path, cli, hub):
    """init from D1 with `--model models/A`: the build records D1/models/A; runs from a directory without a model,
    and from one holding another `models/A`, both use D1's model (no "files changed", the states are its own), and
    nothing ever connects to the hub."""
    d1, empty, d2 = tmp_path / "d1", tmp_path / "empty", tmp_path / "d2"
    for d in (d1, empty, d2):
        d.mkdir()
    make_model(d1 / "models" / "A")
    (d2 / "models").mkdir()
    other_model(d2 / "models" / "A")
    shutil.copy(d1 / "models" / "A" / "tokenizer.json", d2 / "models" / "A")
    shutil.copy(d1 / "models" / "A" / "tokenizer_config.json", d2 / "models" / "A")
    write_jsonl(d1 / "src.jsonl", text_rows(4))

    cp = cli("init", "b", "--source", "src.jsonl", "--model", "models/A", "--aux-layers", "1,2,3", "--final-state",
             "post_norm", *WM, cwd=d1)
    assert cp.returncode == 0, cp.stderr
    build = d1 / "b"
    cfg = tomllib.loads((build / "hsbuild.toml").read_text())
    assert cfg["model"] == str(d1 / "models" / "A") and Path(cfg["model"]).is_absolute()
    assert cfg["source"] == str(d1 / "src.jsonl")
    with EventLog(layout(build).events, read_only=True) as log:
        meta = log.meta()
    assert meta["model"] == str(d1 / "models" / "A") and meta["source"] == str(d1 / "src.jsonl")

    cp = cli("run", build, "--no-progress", "--device", "cpu", "--limit", "2", cwd=empty)
    assert cp.returncode == 0 and "wrote 2" in cp.stdout, cp.stdout + cp.stderr
    cp = cli("run", build, "--no-progress", "--device", "cpu", cwd=d2)
    assert cp.returncode == 0 and "wrote 2" in cp.stdout, cp.stdout + cp.stderr
    assert "changed" not in cp.stdout + cp.stderr
    cp = cli("verify", build, "--no-progress", cwd=d2)
    assert cp.returncode == 0 and "ok 4" in cp.stdout, cp.stdout + cp.stderr
    assert hub.connections == []

    # the states are D1's model's, also for the samples written from D2
    from builder.reader import HiddenStateDataset  # noqa: PLC0415

    ref = transformers.AutoModelForCausalLM.from_pretrained(d1 / "models" / "A", dtype=torch.bfloat16).eval()
    items = list(HiddenStateDataset(build))
    assert len(items) == 4
    for item in items:
        with torch.no_grad():
            hs = ref(input_ids=item["input_ids"].long()[None], output_hidden_states=True).hidden_states
        assert torch.equal(item["hidden_state"].view(torch.int16), hs[4][0].view(torch.int16)), item["sample_id"]


def test_every_path_flag_of_init_is_recorded_absolute(tmp_path, cli, hub):
    """--model, --source and --staging given relative, for an engine build: all three recorded absolute."""
    make_model(tmp_path / "models" / "A")
    (tmp_path / "stg").mkdir()
    write_jsonl(tmp_path / "src.jsonl", random_rows(2, vocab=VOCAB))
    cp = cli("init", "b", "--source", "src.jsonl", "--model", "./models/A", "--backend", "vllm", "--server",
             "http://127.0.0.1:9", "--staging", "stg", *WM, cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr
    cfg = tomllib.loads((tmp_path / "b" / "hsbuild.toml").read_text())
    for key, want in (("model", "models/A"), ("source", "src.jsonl"), ("staging", "stg")):
        assert Path(cfg[key]).is_absolute() and Path(cfg[key]).samefile(tmp_path / want), (key, cfg[key])
    assert cfg["server"] == "http://127.0.0.1:9"
    assert hub.connections == []


def test_builtin_model_specs_are_not_paths(tmp_path, cli):
    write_jsonl(tmp_path / "src.jsonl", random_rows(2))
    spec = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
    cp = cli("init", "b", "--source", "src.jsonl", "--model", spec, *WM, cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert tomllib.loads((tmp_path / "b" / "hsbuild.toml").read_text())["model"] == spec


@pytest.mark.parametrize("kind", ["saved-llama", "qwen2-config-only"])
def test_a_missing_tokenizer_fails_at_once_without_a_connection(tmp_path, cli, hub, kind):
    """A text source and a model directory without a tokenizer: one line naming the directory and the missing
    tokenizer, exit 2, and not one connection to the hub (HF_HUB_OFFLINE is 0: the code itself stays local). A
    Qwen2 config alone would otherwise give an empty tokenizer that turns text into nothing."""
    model = tmp_path / "models" / "A"
    if kind == "saved-llama":
        make_model(model)
        for p in model.iterdir():
            if p.name.startswith(("tokenizer", "special_tokens")):
                p.unlink()
    else:
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 4,
                                                       "hidden_size": 64, "vocab_size": VOCAB}))
    write_jsonl(tmp_path / "src.jsonl", text_rows(2))
    cp = cli("init", "b", "--source", "src.jsonl", "--model", "models/A", *WM, cwd=tmp_path)
    err = one_line_error(cp, "init")
    assert cp.returncode == EXIT_USAGE, cp.stderr
    assert str(model) in err and "tokenizer.json" in err, err
    assert not (tmp_path / "b" / "hsbuild.toml").exists()
    assert hub.connections == []


def test_a_missing_config_fails_at_once_without_a_connection(tmp_path, cli, hub):
    model = tmp_path / "models" / "A"
    make_model(model)
    (model / "config.json").unlink()
    write_jsonl(tmp_path / "src.jsonl", text_rows(2))
    cp = cli("init", "b", "--source", "src.jsonl", "--model", "models/A", *WM, cwd=tmp_path)
    err = one_line_error(cp, "init")
    assert cp.returncode == EXIT_USAGE, cp.stderr
    assert str(model) in err and "config.json" in err, err
    assert hub.connections == []


def test_a_model_directory_that_is_not_there_is_never_looked_up_on_the_hub(tmp_path, cli, hub):
    """`--model org/name` where no such directory exists: a local path that is missing, never a hub repo id."""
    write_jsonl(tmp_path / "src.jsonl", text_rows(2))
    cp = cli("init", "b", "--source", "src.jsonl", "--model", "org/name", *WM, cwd=tmp_path)
    err = one_line_error(cp, "init")
    assert cp.returncode == EXIT_USAGE, cp.stderr
    assert str(tmp_path / "org" / "name") in err, err
    assert hub.connections == []

