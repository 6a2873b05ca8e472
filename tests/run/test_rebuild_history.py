"""A rebuilt log restores the history, not just the data: skipped samples stay skipped, verified ones verified,
failed-then-repaired ones are their repair, and the newer of two attempts wins whatever the wall clock said
(docs/design.md section 11: history records, write order)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import set_config

from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.store.history import history_dir
from builder.store.segment import MANIFEST_DIR, sample_files

VIEW = ("state", "segment", "token_start", "num_tokens", "nbytes", "checksums", "retired_reason", "retired_note",
        "error", "verified", "fingerprint", "row_idx")


def view(build) -> dict[str, dict]:
    """sample_id -> what a user reads of it in the `samples` view (times apart: a rebuilt log's are its own)."""
    with EventLog(layout(build).events, read_only=True) as log:
        rows = log.query_dicts("SELECT *, verified_at IS NOT NULL AS verified FROM samples")
    return {r["sample_id"]: {k: r[k] for k in VIEW} for r in rows}


def lose_the_log(build) -> None:
    for p in layout(build).root.glob("events.duckdb*"):
        p.unlink()


@pytest.fixture
def one_sample_groups(monkeypatch):
    """Each sample its own group (its own shard files): damage planted in one file hits one sample."""
    monkeypatch.setenv("HSBUILD_GROUP_SAMPLES", "1")


def test_a_rebuilt_log_gives_the_same_samples_view(make_build, cli, one_sample_groups):
    """40 samples: 2 skipped, 2 damaged, found by verify and re-extracted by resume, 1 skipped then brought
    back and extracted again, everything else verified. The log lost, rebuilt: the same view, sample by sample
    (before history records: all 40 differed, the skipped ones back as written)."""
    build = make_build(n=40)
    set_config(build, workers=2)
    assert run_build(build, RunOptions(), echo=lambda m: None).exit_code == 0
    b = str(build)
    assert cli("skip", b, "s0003", "s0004", "--reason", "bad row").returncode == 0
    assert cli("skip", b, "s0020", "--reason", "looked bad").returncode == 0
    assert cli("skip", b, "s0020", "--undo").returncode == 0
    rows = view(build)
    data = layout(build).data
    os.truncate(sample_files(data / rows["s0010"]["segment"], "aux_hidden_state", rows["s0010"]["token_start"],
                             rows["s0010"]["num_tokens"])[0], 7)
    sample_files(data / rows["s0011"]["segment"], "input_ids", rows["s0011"]["token_start"],
                 rows["s0011"]["num_tokens"])[0].unlink()
    cp = cli("verify", b)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    cp = cli("resume", b, "--no-progress")
    assert cp.returncode == 0 and "wrote 3" in cp.stdout, cp.stdout + cp.stderr  # s0010, s0011, s0020
    assert cli("verify", b, "--subset", "1/2").returncode == 0
    before = view(build)
    states = [r["state"] for r in before.values()]
    assert states.count("retired") == 2 and states.count("failed") == 0
    assert 0 < sum(r["verified"] for r in before.values()) < 38  # some verified, some only written
    assert before["s0010"]["segment"] != rows["s0010"]["segment"]  # repaired elsewhere
    assert before["s0020"]["segment"] != rows["s0020"]["segment"]

    lose_the_log(build)
    cp = cli("rebuild-log", b, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    after = view(build)
    assert after.keys() == before.keys()
    differ = {sid: {k: (before[sid][k], after[sid][k]) for k in VIEW if before[sid][k] != after[sid][k]}
              for sid in before if before[sid] != after[sid]}
    assert not differ, differ
    out = cp.stdout
    assert "read back 38 sample(s)" in out and "38 good" in out, out
    assert "38 of 40 sample(s) written" in out and "2 skipped" in out and "0 pending" in out, out
    assert "not restored" in out and "next: nothing to extract" in out, out
    cp = cli("resume", b, "--no-progress")
    assert cp.returncode == 0 and "wrote 0" in cp.stdout, cp.stdout + cp.stderr
    assert {it["sample_id"] for it in HiddenStateDataset(build)} == {s for s, r in before.items()
                                                                      if r["state"] != "retired"}


def test_the_newer_attempt_wins_when_the_clock_went_back(make_build, cli, one_sample_groups):
    """s0001 written by a first run, then skipped, brought back and written again by a second run whose clock
    had jumped back: its manifest's written_at is older than the first run's. The rebuilt log follows the order
    the history records give (the runs' ordinals), not the clock: s0001 is the second run's."""
    build = make_build(n=6)
    b = str(build)
    assert run_build(build, RunOptions(), echo=lambda m: None).exit_code == 0
    first = view(build)["s0001"]
    assert cli("skip", b, "s0001", "--reason", "retry it").returncode == 0
    assert cli("skip", b, "s0001", "--undo").returncode == 0
    assert run_build(build, RunOptions(), echo=lambda m: None).written == 1
    second = view(build)["s0001"]
    assert second["segment"] != first["segment"]
    manifests = {seg: list((layout(build).data / seg / MANIFEST_DIR).glob("*.json"))
                 for seg in (first["segment"], second["segment"])}
    t_first = max(json.loads(p.read_bytes())["written_at"] for p in manifests[first["segment"]])
    for p in manifests[second["segment"]]:  # the second run's clock: an hour behind the first's
        m = json.loads(p.read_bytes())
        m["written_at"] = t_first - 3600
        p.write_text(json.dumps(m))
    before = view(build)
    lose_the_log(build)
    cp = cli("rebuild-log", b, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    after = view(build)
    assert after["s0001"] == before["s0001"] == second, (after["s0001"], second)
    assert after == before


def test_history_records_are_never_orphans_and_a_damaged_one_is_refused(make_build, cli):
    """The records a run, a skip and a sweep write are no orphans to verify and gc, which keep them byte for byte
    (a temp file a crash left beside them is reclaimed); a damaged record makes rebuild-log refuse in one line
    naming it, before anything changes."""
    build = make_build(n=4)
    b = str(build)
    assert run_build(build, RunOptions(), echo=lambda m: None).exit_code == 0
    assert cli("skip", b, "s0001", "--reason", "bad").returncode == 0
    assert cli("verify", b).returncode == 0
    hist = history_dir(layout(build).data)
    records = {p.name: p.read_bytes() for p in hist.iterdir()}
    assert sorted(n.split("-")[1] for n in records) == ["run", "skip", "verify"], records
    stray = hist / ".0000000004-skip-0badc0de.json.4242.tmp"  # a skip killed mid-write
    stray.write_bytes(b'{"format"')
    cp = cli("verify", b, "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    reclaimable = json.loads(cp.stdout)["reclaimable"]
    assert (reclaimable["count"], reclaimable["by_kind"]) == (1, {"tmp": 1}), reclaimable
    records = {p.name: p.read_bytes() for p in hist.iterdir() if p != stray}
    assert len(records) == 4  # (and that sweep's own)
    assert cli("gc", b).returncode == 0
    assert not stray.exists()
    assert {p.name: p.read_bytes() for p in hist.iterdir()} == records

    skip_record = next(hist / n for n in records if "-skip-" in n)
    skip_record.write_bytes(b"\x00" * 40)
    log_before = layout(build).events.read_bytes()
    cp = cli("rebuild-log", b, "--no-progress")
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and str(skip_record) in cp.stderr and "move it" in cp.stderr
    assert layout(build).events.read_bytes() == log_before
    assert not list(layout(build).root.glob("*.damaged-*"))
