"""An fp8 build's states are lossy, and whatever gives them out says so: every export writes `hsbuild-lossy.json`
beside its files (the scheme, its scale blocks and the error measured when each sample was written), its report
and the export command carry it, `BuildInfo.lossy` holds the scheme and `HiddenStateDataset.lossy` the figures
for its samples. A build stored exactly says nothing of the kind (None, no file)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOMY, hsbuild, random_rows, write_jsonl

from builder.exchange.export import ExportOptions, export_build
from builder.formats.build_info import BuildInfo
from builder.formats.lossy import LOSSY_FILE
from builder.layout import layout
from builder.log.query import run_query
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store.codec import FP8_SCHEME

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
N = 10


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("lossy")
    src = write_jsonl(base / "src.jsonl", random_rows(N, seed=7, lo=10, hi=60))
    out = {}
    for q in ("none", "fp8"):
        b = init_build(base / q, src, model=MODEL, watermarks=ROOMY, quantize=q).root
        assert run_build(b, RunOptions(workers=1), echo=lambda m: None).written == N
        out[q] = b
    return out, base


def recorded(build) -> dict[str, dict]:
    _, rows = run_query(layout(build), "SELECT sample_id, detail FROM events WHERE kind = 'written'")
    return {sid: json.loads(d)["fp8_error"] for sid, d in rows}


def assert_figures(lossy: dict, errors: dict[str, dict], ids: list[str]) -> None:
    assert lossy["scheme"] == FP8_SCHEME and lossy["lossy"] is True and lossy["read_as"] == "bfloat16"
    assert lossy["scale_block"] == {"hidden_state": 64, "aux_hidden_state": 3 * 64}
    assert lossy["samples"] == lossy["samples_measured"] == len(ids)
    for f in ("hidden_state", "aux_hidden_state"):
        vals = [errors[s][f] for s in ids]
        got = lossy["error"][f]
        assert got["max"] == pytest.approx(max(vals), abs=1e-6) and got["mean"] == pytest.approx(sum(vals) / len(vals),
                                                                                                abs=1e-6)
        assert errors[got["max_sample_id"]][f] == max(vals)
        assert 0 < got["mean"] <= got["max"] < 0.1, got


def test_build_info_says_lossy_for_fp8_only(builds):
    b, _ = builds
    assert BuildInfo.load(layout(b["none"])).lossy is None
    info = BuildInfo.load(layout(b["fp8"]))
    assert info.lossy is not None and info.lossy["scheme"] == FP8_SCHEME


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "modelopt"])
def test_an_fp8_export_carries_its_scheme_and_measured_error(builds, fmt):
    b, base = builds
    errors = recorded(b["fp8"])
    out = base / f"fp8-{fmt}"
    rep = export_build(b["fp8"], out, ExportOptions(format=fmt, limit=7))
    on_disk = json.loads((out / LOSSY_FILE).read_text())
    assert rep.lossy == on_disk
    ids = HiddenStateDataset(b["fp8"]).index[:7]
    assert_figures(on_disk, errors, [e["sample_id"] for e in ids])
    assert on_disk["stored_final_state"] == "pre_norm"
    assert ("note" in on_disk) == (fmt != "speculators"), "a derived post-norm state is named as such"
    if fmt == "modelopt":
        assert not list(out.rglob("*.json.pt")) and LOSSY_FILE.endswith(".json")  # never read as a sample

    exact = base / f"none-{fmt}"
    rep = export_build(b["none"], exact, ExportOptions(format=fmt))
    assert rep.lossy is None and not (exact / LOSSY_FILE).exists()


def test_the_dataset_exposes_it(builds):
    b, _ = builds
    assert HiddenStateDataset(b["none"]).lossy is None
    assert HiddenStateDataset(b["none"], format="specforge").lossy is None
    ds = HiddenStateDataset(b["fp8"])
    assert_figures(ds.lossy, recorded(b["fp8"]), [e["sample_id"] for e in ds.index])
    assert "note" not in ds.lossy  # the stored convention
    assert "note" in HiddenStateDataset(b["fp8"], format="modelopt").lossy


def test_the_export_command_prints_it(builds):
    b, base = builds
    cp = hsbuild("export", b["fp8"], base / "cli-fp8", "--format", "speculators", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    line = [ln for ln in cp.stdout.splitlines() if ln.startswith("LOSSY:")]
    assert len(line) == 1 and FP8_SCHEME in line[0] and LOSSY_FILE in line[0] and "max" in line[0], cp.stdout
    cp = hsbuild("export", b["fp8"], base / "cli-fp8-json", "--format", "modelopt", "--no-progress", "--json")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["lossy"]["scheme"] == FP8_SCHEME
    cp = hsbuild("export", b["none"], base / "cli-none", "--format", "speculators", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert "LOSSY" not in cp.stdout and LOSSY_FILE not in cp.stdout and FP8_SCHEME not in cp.stdout
