"""How many readers a sweep starts without --jobs (`verify.selection.default_jobs`): one where samples are small
enough that readers would only wait for each other's GIL, on any number of cores; min(4, CPUs) for large samples
and quick sweeps; --jobs overrides it. The sweep records what it used in `verify_started`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOMY, random_rows, write_jsonl
from verify_helpers import TINY, copy_build, events, live, sweep

from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.verify import selection
from builder.verify import sweep as sweep_mod
from builder.verify.selection import PARALLEL_FROM_BYTES, default_jobs

TINY_SAMPLE, SEED_SAMPLE = 9_000, 100_000_000  # compressed bytes a sample: 8-32 tokens x hidden 64; the seed's


@pytest.mark.parametrize("cpus", [1, 2, 16, 128])
def test_small_samples_get_one_reader_on_any_number_of_cores(cpus):
    assert default_jobs(False, TINY_SAMPLE, cpus) == 1
    assert default_jobs(False, PARALLEL_FROM_BYTES - 1, cpus) == 1
    assert default_jobs(False, 0, cpus) == 1  # (nothing selected)


@pytest.mark.parametrize(("cpus", "readers"), [(1, 1), (2, 2), (3, 3), (4, 4), (16, 4), (128, 4)])
def test_large_samples_and_quick_sweeps_get_a_reader_a_cpu_up_to_four(cpus, readers):
    assert default_jobs(False, SEED_SAMPLE, cpus) == readers
    assert default_jobs(False, PARALLEL_FROM_BYTES, cpus) == readers
    assert default_jobs(True, TINY_SAMPLE, cpus) == readers  # a quick sweep reads no chunk data


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jobs")
    src = write_jsonl(root / "source.jsonl", random_rows(6, seed=2, lo=8, hi=32))
    lay = init_build(root / "template", src, watermarks=ROOMY, model=TINY)
    run_build(lay.root, RunOptions(), echo=lambda m: None)
    return lay.root


def started_jobs(build: Path) -> list[int]:
    return [json.loads(e["detail"])["jobs"] for e in events(build, "WHERE kind = 'verify_started'")]


def test_a_sweep_picks_its_readers_from_its_samples(template, tmp_path, monkeypatch):
    build = copy_build(template, tmp_path / "b")
    monkeypatch.setattr(sweep_mod, "usable_cpus", lambda: 16)
    mean = sum(r["nbytes"] for r in live(build).values()) / 6
    assert mean < PARALLEL_FROM_BYTES  # tiny samples: one reader, even with 16 CPUs
    assert sweep(build).ok == 6
    assert sweep(build, quick=True).ok == 6
    monkeypatch.setattr(selection, "PARALLEL_FROM_BYTES", int(mean))  # as if they were large
    assert sweep(build).ok == 6
    assert sweep(build, jobs=3).ok == 6  # --jobs overrides
    assert started_jobs(build) == [1, 4, 4, 3]
