"""The opt-in FP8 store (`init --quantize fp8`): states kept as float8_e4m3fn with a float32 scale a token, the
quantization speculators' FP8 connector applies (checked against its own `hs_connectors.fp8_utils`), read back
dequantized, checksummed over the stored bytes, each sample's round-trip error in its `written` event."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from builder.errors import EXIT_USAGE
from builder.log.query import run_query
from builder.reader import HiddenStateDataset
from builder.store.codec import FP8_SCHEME, dequantize_fp8, quantize_fp8
from builder.store.reader import SegmentReader
from builder.store.segment import SegmentWriter, init_data_group
from tests.conftest import random_rows, write_jsonl

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"


def states(n: int, width: int, seed: int = 0) -> torch.Tensor:
    """bf16 states with what real activations have: outlier channels, a token of zeros, tiny and huge rows."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, width, generator=g)
    t[:, 3] *= 80.0  # an outlier channel
    t[1] = 0.0
    t[2] *= 1e-6
    t[3] *= 1e4
    return t.to(torch.bfloat16)


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got.float() - ref.float()) / torch.linalg.vector_norm(ref.float()))


def test_the_rows_are_what_speculators_fp8_connector_stores():
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils", reason="speculators' hs-connectors is not installed "
                                    "(pip install -e '.[trainers]' and hs-connectors --no-deps, as .ci/run does)")
    t = states(40, 3 * 48)
    rows = quantize_fp8(t)
    assert rows.dtype == np.uint8 and rows.shape == (40, 3 * 48 + 4)
    q, scale = fp8_utils.quantize_tensor_to_fp8(t)
    assert np.array_equal(rows[:, :-4], q.view(torch.uint8).numpy())
    assert np.array_equal(rows[:, -4:].copy().view("<f4")[:, 0], scale[:, 0].numpy())
    want = fp8_utils.dequantize_fp8_tensor(q, scale, torch.bfloat16)
    got = dequantize_fp8(rows, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the zero token reads back as zeros; every token's error is within fp8's 3 mantissa bits
    assert torch.count_nonzero(got[1]) == 0
    per_token = (got.float() - t.float()).abs().amax(1) / t.float().abs().amax(1).clamp(min=1e-30)
    assert float(per_token.max()) <= 2 ** -4


def test_a_segment_stores_fp8_rows_and_reads_them_back_dequantized(tmp_path):
    root = tmp_path / "data"
    init_data_group(root, {})
    n, hidden, n_aux = 70, 32, 3
    aux, final = states(n, n_aux * hidden, 1), states(n, hidden, 2)
    ids = np.arange(n, dtype=np.int32)
    mask = np.ones(n, dtype=np.uint8)
    w = SegmentWriter(root, "seg-a", hidden, n_aux, chunk_tokens=16, codec="blosc-lz4-bitshuffle:5",
                      quantize="fp8").create()
    loc = w.write(ids, mask, aux, final)
    w.seal()
    # zarr itself reads the stored arrays: uint8 rows of fp8 values and a scale, marked as quantized
    arr = zarr.open_group(str(root / "seg-a"), mode="r")["aux_hidden_state"]
    assert arr.dtype == np.uint8 and arr.shape[1] == n_aux * hidden + 4
    assert arr.attrs["quantized"] == FP8_SCHEME and arr.attrs["logical_dtype"] == "bfloat16"
    assert np.array_equal(arr[loc.token_start : loc.token_start + n], quantize_fp8(aux))
    got = SegmentReader(root).read(loc.segment, loc.token_start, n, loc.checksums)
    assert got["aux_hidden_state"].dtype == torch.bfloat16
    rows = quantize_fp8(aux)  # read back as torch's own fp8 conversion gives, times the token's scale
    q = torch.from_numpy(np.ascontiguousarray(rows[:, :-4])).view(torch.float8_e4m3fn).to(torch.bfloat16)
    scale = torch.from_numpy(np.ascontiguousarray(rows[:, -4:]).view("<f4").copy()).to(torch.bfloat16)
    assert torch.equal(got["aux_hidden_state"].view(torch.int16), (q * scale).view(torch.int16))
    assert torch.equal(got["hidden_state"], dequantize_fp8(quantize_fp8(final)))
    assert np.array_equal(got["input_ids"].numpy(), ids)
    assert loc.quant_error is not None
    assert loc.quant_error["aux_hidden_state"] == pytest.approx(rel_rms(got["aux_hidden_state"], aux), rel=1e-5)
    assert 0 < loc.quant_error["hidden_state"] < 0.05


def test_an_fp8_build_end_to_end(tmp_path, cli):
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(12, seed=3, lo=20, hi=90))
    builds = {}
    for q in ("none", "fp8"):
        b = tmp_path / f"b-{q}"
        cli("init", b, "--source", src, "--model", MODEL, "--codec", "none", "--quantize", q, "--low", "0.99",
            "--high", "0.995", "--flood", "0.999", check=True)
        cli("run", b, check=True)
        builds[q] = b
    b = builds["fp8"]
    assert 'quantize = "fp8"' in (b / "hsbuild.toml").read_text()
    meta = json.loads((b / "data" / "zarr.json").read_text())["attributes"]["hsbuild_meta"]
    assert meta["quantize"]["scheme"] == FP8_SCHEME and meta["format"]["quantize"] == "fp8"
    v = cli("verify", b, "--json")
    assert v.returncode == 0, v.stdout + v.stderr

    exact, lossy = HiddenStateDataset(builds["none"]), HiddenStateDataset(b)
    assert len(lossy) == len(exact) == 12
    _, rows = run_query(lossy.lay, "SELECT sample_id, json_extract(detail, '$.fp8_error') FROM events "
                                   "WHERE kind = 'written' ORDER BY sample_id")
    recorded = {sid: json.loads(e) for sid, e in rows}
    for i in range(len(exact)):
        a, q = exact[i], lossy[i]
        assert a["sample_id"] == q["sample_id"] and torch.equal(a["input_ids"], q["input_ids"])
        for f in ("hidden_state", "aux_hidden_state"):
            assert q[f].dtype == torch.bfloat16 and q[f].shape == a[f].shape
            err = rel_rms(q[f], a[f])
            assert 0 < err < 0.05, (q["sample_id"], f, err)
            assert recorded[q["sample_id"]][f] == pytest.approx(err, rel=0.05, abs=1e-4)

    def state_bytes(build):
        return sum(p.stat().st_size for p in (build / "data").rglob("*") if p.is_file()
                   and p.parent.name in ("hidden_state", "aux_hidden_state"))

    assert state_bytes(b) <= 0.55 * state_bytes(builds["none"])

    # the store is part of the format: a config that changes it is refused, and nothing is written
    toml = b / "hsbuild.toml"
    toml.write_text(toml.read_text().replace('quantize = "fp8"', 'quantize = "none"'))
    r = cli("run", b)
    assert r.returncode == EXIT_USAGE and "quantize" in r.stderr, r.stderr
    bad = cli("init", tmp_path / "b-bad", "--source", src, "--model", MODEL, "--quantize", "fp4")
    assert bad.returncode == EXIT_USAGE and "--quantize" in bad.stderr
