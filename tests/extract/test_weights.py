"""A Hugging Face model's fingerprint covers its files' contents, not just their sizes, and the per-file digest
cache is trusted only while a file's device, inode, size, mtime and ctime are unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import ROOMY, random_rows, write_jsonl

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HSBUILD_CACHE_DIR", str(tmp_path / "cache"))


def tiny_llama(path: Path, seed: int = 0) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def rewrite_same_size_keep_times(path: Path, data: bytes) -> None:
    """Overwrite every byte in place (same inode, same size) and put atime/mtime back, as a nasty copy would."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_ino == st.st_ino and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_rewritten_weights_of_the_same_size_are_refused(tmp_path, cli):
    model = tiny_llama(tmp_path / "tiny-llama")
    other = tiny_llama(tmp_path / "other-llama", seed=1)
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(3, vocab=512))
    from builder.run.create import init_build

    build = init_build(tmp_path / "b", src, model=str(model), aux_layers=[1, 3, 5], watermarks=ROOMY).root
    weights = model / "model.safetensors"
    new = (other / "model.safetensors").read_bytes()
    assert new != weights.read_bytes()
    rewrite_same_size_keep_times(weights, new)

    cp = cli("run", build, "--no-progress", "--device", "cpu")
    assert cp.returncode == 4, cp.stderr
    err = cp.stderr.strip()
    assert err.startswith("hsbuild run: error:") and "\n" not in err and "Traceback" not in err
    assert "model fingerprint" in err and "changed since `init`" in err
    cp = cli("resume", build, "--no-progress", "--device", "cpu", "--force")  # never overridable
    assert cp.returncode == 4 and "model fingerprint" in cp.stderr, cp.stderr
    cp = cli("sql", build, "SELECT count(*) AS n FROM events WHERE kind IN ('started', 'written')", "--json")
    assert json.loads(cp.stdout) == [{"n": 0}]


def test_digest_cache_is_used_only_while_the_file_is_unchanged(tmp_path):
    from builder.extract.weights import CACHE_NAME, DigestCache, directory_fingerprint

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    w = d / "model.safetensors"
    w.write_bytes(b"a" * 1000)
    fp = directory_fingerprint(d)
    assert directory_fingerprint(d) == fp  # stable

    # the cache answers while the key holds: a planted digest shows up in the fingerprint ...
    cache_file = tmp_path / "cache" / CACHE_NAME
    data = json.loads(cache_file.read_text())
    data["files"][os.path.realpath(w)]["digest"] = "0" * 64
    cache_file.write_text(json.dumps(data))
    planted = directory_fingerprint(d)
    assert planted != fp
    # ... and not once the file was written to, even with its mtime put back (ctime moved on)
    rewrite_same_size_keep_times(w, b"a" * 1000)
    assert directory_fingerprint(d) == fp
    rewrite_same_size_keep_times(w, b"b" * 1000)
    assert directory_fingerprint(d) not in (fp, planted)
    # an unusable cache file only costs time
    cache_file.write_text("not json")
    assert directory_fingerprint(d) == directory_fingerprint(d, DigestCache(tmp_path / "elsewhere"))


def test_hub_snapshot_blobs_are_named_by_their_hash(tmp_path):
    from builder.extract.weights import CACHE_NAME, directory_fingerprint

    blobs = tmp_path / "hub" / "blobs"
    snap = tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("a" * 64, "b" * 64, "c" * 40):
        (blobs / name).write_bytes(name.encode())
    (snap / "config.json").symlink_to(blobs / ("c" * 40))
    (snap / "model.safetensors").symlink_to(blobs / ("a" * 64))
    fp = directory_fingerprint(snap)
    assert not (tmp_path / "cache" / CACHE_NAME).exists()  # nothing read, nothing cached
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / ("b" * 64))  # the snapshot moved to another revision
    assert directory_fingerprint(snap) != fp
