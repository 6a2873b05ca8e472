"""An export is a view of the build: re-running it brings OUT to the build's present state, whatever happened to
the build since (a sample skipped, a source row changed and re-extracted, a sample damaged, samples repaired or
extracted later), and whatever happened to the export (kill -9 at any moment, a full volume). After every re-run
OUT holds exactly the files a fresh export of the same build state writes into a new folder, byte for byte; row
i of the export is file i of the same sample (speculators' own ArrowDataset reads every row, no warning); no
selected sample is ever left out without being named (exit 1).

Real builds (the small built-in model), the real CLI in subprocesses, real trainer code where installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import crc32c
import forked
import pyarrow as pa
import pytest
import torch
from conftest import hsbuild, mounted_tmpfs, random_rows, write_jsonl
from test_export import (
    assert_all_equal,
    flip_byte,
    modelopt_items,
    specforge_items,
    speculators_items,
    trainer_available,
)

from builder.config import BuildConfig, Watermarks
from builder.errors import DiskFullError, UsageError
from builder.exchange import export_space
from builder.exchange.export import JOURNAL, STAGING, TMP_SUFFIX, ExportOptions, export_build
from builder.formats.modelopt import ModelOpt
from builder.formats.speculators import ARROW
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build

FORMATS = ("specforge", "speculators", "modelopt")


# -- helpers -------------------------------------------------------------------------------------------------------

def tree(out: Path) -> dict[str, bytes]:
    """Every file of the export but its journal, by relative path."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != JOURNAL}


def assert_same_tree(got: Path, want: Path, what: str) -> None:
    a, b = tree(got), tree(want)
    assert sorted(a) == sorted(b), f"{what}: files {sorted(set(a) ^ set(b))} differ from a fresh export's"
    differ = sorted(rel for rel in a if a[rel] != b[rel])
    assert not differ, f"{what}: {differ} hold other bytes than a fresh export's"
    dirs = sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_dir())
    assert dirs == sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_dir()), f"{what}: folders"


def journal(out: Path) -> dict:
    return json.loads((out / JOURNAL).read_text())


def export_cli(build: Path, out: Path, fmt: str, *flags: str) -> tuple[int, dict, str]:
    cp = hsbuild("export", build, out, "--format", fmt, "--no-progress", "--json", *flags)
    assert "Traceback" not in cp.stderr, cp.stderr
    return cp.returncode, json.loads(cp.stdout), cp.stderr


def samples(build: Path, where: str = "") -> dict[str, dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return {r["sample_id"]: r for r in log.samples(where)}


def build_tokens(build: Path, sids: list[str]) -> dict[str, torch.Tensor]:
    """The build's tokens of these samples (read checked), in the build's order."""
    ds, want = HiddenStateDataset(build), set(sids)
    return {e["sample_id"]: ds[i]["input_ids"] for i, e in enumerate(ds.index) if e["sample_id"] in want}


def assert_rows_match_files(build: Path, out: Path, fmt: str) -> None:
    """Row i of the export (the journal's selection; speculators' Arrow row i) is file i of the same sample: its
    tokens are the file's and the build's."""
    sel = journal(out)["selection"]
    toks = build_tokens(build, sel)
    assert sel == list(toks), "rows follow the build's order"
    for i, sid in enumerate(sel):
        if fmt == "specforge":
            d = torch.load(out / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}" / f"data_{i}.ckpt",
                           weights_only=True)
            got = d["input_ids"]
        elif fmt == "speculators":
            from safetensors.torch import load_file

            got = load_file(out / "hidden_states" / f"hs_{i}.safetensors")["token_ids"]
        else:
            d = torch.load(out / ModelOpt.file_name(sid), weights_only=True)
            assert d["conversation_id"] == sid
            got = d["input_ids"]
        assert torch.equal(got, toks[sid]), f"{fmt} row {i} ({sid}): the file's tokens are not the sample's"
    if fmt == "speculators":
        assert [toks[s].tolist() for s in sel] == arrow_input_ids(out), "Arrow row i is not sample i"


def arrow_input_ids(out: Path) -> list[list[int]]:
    """The `input_ids` column of speculators' Arrow dataset, row by row: read with pyarrow (a core dependency),
    and where `datasets` is installed (the trainers extra: pip install -e '.[trainers]') as the trainer loads
    it too, which must agree."""
    with pa.OSFile(str(out / ARROW)) as f:
        rows = pa.ipc.open_stream(f).read_all().column("input_ids").to_pylist()
    if trainer_available("datasets"):
        from datasets import load_from_disk  # noqa: PLC0415

        assert load_from_disk(str(out)).with_format(None)["input_ids"] == rows, "datasets reads other rows"
    return rows


def assert_trainer_reads(build: Path, out: Path, fmt: str, what: str) -> None:
    """The trainer's own dataset class reads every row, and each item is the build's (bit for bit)."""
    module = {"specforge": "specforge.data.preprocessing", "speculators": "speculators.train.data",
              "modelopt": "modelopt.torch.speculative.eagle.utils"}[fmt]
    if not trainer_available(module):
        return
    if fmt == "speculators":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = speculators_items(out)  # on_missing="raise": a row without its file raises
        mine = [str(w.message) for w in caught if "speculators" in w.filename or "hs_connectors" in w.filename]
        assert not mine, f"{what}: speculators warned {mine}"
    elif fmt == "specforge":
        got = specforge_items(out, 2048)
    else:
        got = modelopt_items(out)
    sel = set(journal(out)["selection"])
    ds = HiddenStateDataset(build, format=fmt, max_len=2048 if fmt == "specforge" else None)
    want = {e["sample_id"]: ds[i] for i, e in enumerate(ds.index) if e["sample_id"] in sel}
    assert_all_equal(got, want, f"{what} {fmt}")


def change_source_row(build: Path, sid: str) -> None:
    """Edit one row of the build's source (another token value, same length): `resume --accept-source-changes`
    re-extracts it."""
    src = Path(BuildConfig.from_toml(layout(build).config).source)
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    for r in rows:
        if r["id"] == sid:
            r["input_ids"][0] = 3 + (r["input_ids"][0] + 1) % 1000
    write_jsonl(src, rows)


def cli_ok(*args, rc: int = 0) -> subprocess.CompletedProcess:
    cp = hsbuild(*args, "--no-progress") if args[0] in ("resume", "run") else hsbuild(*args)
    assert cp.returncode == rc, f"hsbuild {args}: exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return cp


def stamps(out: Path) -> dict[str, tuple[int, int]]:
    """sample id -> (inode, mtime) of its file, through the journal."""
    return {sid: (os.stat(out / v[0]).st_ino, os.stat(out / v[0]).st_mtime_ns) for sid, v in journal(out)["files"].items()}


# -- 1. skip, accept-source-changes, damage, repair: the re-export is a fresh export ----------------------------

def test_reexport_after_skip_change_and_damage_equals_a_fresh_export(make_build, tmp_path):
    rows = random_rows(10, seed=21, lo=35, hi=48)
    build = make_build(rows=rows, codec="none", chunk_tokens=16, final_state="pre_norm")  # serves all three
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 10
    outs = {fmt: tmp_path / f"out-{fmt}" for fmt in FORMATS}
    for fmt, out in outs.items():
        rep = export_build(build, out, ExportOptions(format=fmt, draft_vocab_size=32))
        assert rep.complete and rep.rows == 10 and sorted(rep.added) == sorted(r["id"] for r in rows)
        j = journal(out)
        assert j["finished"] and j["complete"] and len(j["files"]) == 10
        for sid, (path, fp, digest, size) in j["files"].items():  # the journal: per sample, its file's checksum
            data = (out / path).read_bytes()
            assert digest == f"crc32c:{crc32c.crc32c(data):08x}" and len(data) == size, sid
            assert len(fp) == 32
    before = {fmt: journal(out)["files"] for fmt, out in outs.items()}
    old_stamps = {fmt: stamps(out) for fmt, out in outs.items()}

    # the build changes: s0002 skipped, s0005's source row edited and re-extracted, s0007 damaged (verify finds it)
    cli_ok("skip", build, "s0002", "--reason", "test")
    change_source_row(build, "s0005")
    cli_ok("resume", build, "--accept-source-changes")
    flip_byte(build, samples(build)["s0007"], "hidden_state")
    cli_ok("verify", build, rc=1)
    assert samples(build)["s0007"]["state"] == "failed"

    for fmt, out in outs.items():
        rc, rep, err = export_cli(build, out, fmt, "--draft-vocab-size", "32")
        assert rc == 1, f"{fmt}: a selected sample left out must say so in the exit code\n{err}"
        assert rep["rewritten"] == ["s0005"] and rep["added"] == [], rep
        assert rep["removed"] == ["s0002", "s0007"], rep
        assert [(d["sample_id"], d["state"], d["reason"]) for d in rep["not_exported"]] == \
            [("s0007", "failed", "checksum_mismatch")]
        assert rep["rows"] == 8 and rep["already"] == 7 and rep["exported"] == 1 and not rep["complete"]
        j = journal(out)
        assert j["finished"] and not j["complete"] and sorted(j["files"]) == sorted(j["selection"])
        assert j["files"]["s0005"][1] != before[fmt]["s0005"][1]  # its fingerprint follows the new states
        # kept files are not rewritten (speculators and specforge renumber them: moved, same inode and mtime)
        now = stamps(out)
        for sid in set(now) - {"s0005"}:
            assert now[sid] == old_stamps[fmt][sid], f"{fmt} {sid}: rewritten"
        renumbered = 0 if fmt == "modelopt" else 5  # the rows after s0002 move up (s0007 leaves too)
        assert rep["renumbered"] == renumbered, rep

        fresh = tmp_path / f"fresh-{fmt}"
        assert export_cli(build, fresh, fmt, "--draft-vocab-size", "32")[0] == 1
        assert_same_tree(out, fresh, f"{fmt} after skip/change/damage")
        assert_rows_match_files(build, out, fmt)
        assert_trainer_reads(build, out, fmt, "after skip/change/damage")
        assert not (out / STAGING).exists() and not list(out.rglob("*" + TMP_SUFFIX))

    # repaired: the next run of the same export takes s0007 back, at its row
    cli_ok("resume", build)
    for fmt, out in outs.items():
        rc, rep, err = export_cli(build, out, fmt, "--draft-vocab-size", "32")
        assert rc == 0, err
        assert rep["added"] == ["s0007"] and rep["rewritten"] == [] and rep["removed"] == [] and rep["complete"]
        fresh = tmp_path / f"fresh2-{fmt}"
        assert export_cli(build, fresh, fmt, "--draft-vocab-size", "32")[0] == 0
        assert_same_tree(out, fresh, f"{fmt} after the repair")
        assert_rows_match_files(build, out, fmt)
        assert_trainer_reads(build, out, fmt, "after the repair")
        # and once more: nothing to do, nothing touched
        st = stamps(out)
        rc, rep, _ = export_cli(build, out, fmt, "--draft-vocab-size", "32")
        assert rc == 0 and (rep["exported"], rep["renumbered"], rep["removed"], rep["already"]) == (0, 0, [], 9)
        assert stamps(out) == st


def test_text_report_names_added_rewritten_and_removed(make_build, tmp_path):
    build = make_build(rows=random_rows(5, seed=4, lo=10, hi=20), final_state="pre_norm")
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 5
    out = tmp_path / "out"
    export_build(build, out, ExportOptions(format="speculators"))
    cli_ok("skip", build, "s0001", "--reason", "test")
    change_source_row(build, "s0003")
    cli_ok("resume", build, "--accept-source-changes")
    cp = hsbuild("export", build, out, "--format", "speculators", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    first = cp.stdout.splitlines()[0]
    assert "4 sample(s) in it; 0 added, 1 rewritten, 1 removed, 2 renumbered, 3 kept" in first, cp.stdout
    assert "rewritten: s0003" in cp.stdout and "removed: s0001" in cp.stdout and "added:" not in cp.stdout


# -- 2. kill -9 at any moment of a reconcile, then a re-run: a fresh export's files -------------------------------

# The CLI in a subprocess that SIGKILLs itself right after its K-th rename (a file or the journal put in place:
# the steps of an export's write order), or, with K = 0, counts its renames and prints the count last.
KILL_AT_RENAME = """
import os, signal, sys
from builder.cli.app import main
k, count, real = int(sys.argv[1]), [0], os.replace
def replace(a, b, **kw):
    real(a, b, **kw)
    count[0] += 1
    if count[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
rc = main(sys.argv[2:])
print(count[0])
sys.exit(rc)
"""


def _inode(p: Path) -> int | None:
    try:
        return os.stat(p).st_ino
    except FileNotFoundError:
        return None


def _finished(out: Path) -> bool:
    try:
        return journal(out)["finished"]
    except (OSError, ValueError):
        return False


def _run_and_kill(build: Path, out: Path, delay: float | None) -> tuple[int | None, float]:
    """Start the export; once it has rewritten its journal (its run has begun changing OUT) wait `delay` s and
    kill -9 it (None: let it finish). Returns (its exit code, or None if killed; seconds from that journal write
    to the journal saying finished)."""
    before = _inode(out / JOURNAL)
    proc = forked.Popen([sys.executable, "-m", "builder.cli", "export", str(build), str(out), "--format",
                             "speculators", "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _inode(out / JOURNAL) == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        began = time.monotonic()
        if delay is None:
            while not _finished(out) and proc.poll() is None:
                time.sleep(0.0005)
            span = time.monotonic() - began
            proc.wait(timeout=120)
            return proc.returncode, span
        time.sleep(delay)
        if proc.poll() is not None:
            return proc.returncode, time.monotonic() - began
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None, delay
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _rerun(build: Path, out: Path) -> int:
    """The export run again after a kill, to its end (the CLI in this process): its exit code."""
    return hsbuild("export", build, out, "--format", "speculators", "--no-progress").returncode


def _kill_at_rename(build: Path, out: Path, k: int) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", KILL_AT_RENAME, str(k), "export", str(build), str(out),
                           "--format", "speculators", "--no-progress"], capture_output=True, text=True, timeout=300)


@pytest.mark.claim("crash")
def test_kill_9_mid_reconcile_then_rerun_gives_a_fresh_exports_files(make_build, tmp_path):
    rows = random_rows(80, seed=8, lo=5, hi=40)
    build = make_build(rows=rows, final_state="pre_norm")
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 80
    out = tmp_path / "out"
    export_build(build, out, ExportOptions(format="speculators"))
    # every later row renumbered (two early ones skipped), a fifth of them rewritten (their source rows edited)
    cli_ok("skip", build, "s0001", "s0004", "--reason", "test")
    for i in range(6, 80, 5):
        change_source_row(build, f"s{i:04d}")
    cli_ok("resume", build, "--accept-source-changes")
    fresh = tmp_path / "fresh"
    assert export_build(build, fresh, ExportOptions(format="speculators")).complete

    # how many renames an uninterrupted reconcile of this change makes (sample files, moves, journal saves)
    probe = tmp_path / "probe"
    shutil.copytree(out, probe)
    cp = _kill_at_rename(build, probe, 0)
    assert cp.returncode == 0, cp.stderr
    renames = int(cp.stdout.split()[-1])
    assert renames > 78 + 15, renames  # every kept row moved twice (through staging), every changed one written
    assert_same_tree(probe, fresh, "uninterrupted reconcile")

    # killed right after the k-th rename, for k spread over the whole reconcile, then run again
    points = sorted({1, 2, 3, renames - 2, renames - 1, *range(4, renames - 2, max(1, renames // 8))})
    for k in points:
        work = tmp_path / f"at{k}"
        shutil.copytree(out, work)
        cp = _kill_at_rename(build, work, k)
        assert cp.returncode == -signal.SIGKILL, f"rename {k}: exit {cp.returncode}\n{cp.stderr}"
        assert journal(work)["hsbuild_export"] == 2  # whole after every kill (written atomically)
        assert _rerun(build, work) == 0
        assert_same_tree(work, fresh, f"killed after rename {k} of {renames}")
        shutil.rmtree(work)

    # and at random moments, twice in a row before the run that finishes
    work = tmp_path / "probe2"
    shutil.copytree(out, work)
    rc, span = _run_and_kill(build, work, None)  # how long the reconcile runs, to its journal saying finished
    assert rc == 0
    rng = random.Random(29)
    kills = 0
    for attempt in range(2):
        work = tmp_path / f"random{attempt}"
        shutil.copytree(out, work)
        for _ in range(2):
            rc, _ = _run_and_kill(build, work, rng.uniform(0.0, span))
            kills += rc is None
            assert journal(work)["hsbuild_export"] == 2
        assert _rerun(build, work) == 0
        assert_same_tree(work, fresh, f"random kills, attempt {attempt}")
        assert_rows_match_files(build, work, "speculators")
    assert kills >= 2, f"killed mid-way only {kills} time(s)"
    assert_trainer_reads(build, work, "speculators", "after kills")


# -- 3. never silently short: damaged and not-yet-written samples are named, and exported once repaired -------------

def test_export_names_damaged_and_unwritten_samples_and_takes_them_after_repair(make_build, tmp_path):
    rows = random_rows(10, seed=5, lo=35, hi=48)
    build = make_build(rows=rows, codec="none", chunk_tokens=16)
    assert run_build(build, RunOptions(workers=1, limit=8), echo=lambda m: None).written == 8
    live = samples(build)
    flip_byte(build, live["s0002"], "hidden_state")
    flip_byte(build, live["s0006"], "aux_hidden_state")

    out = tmp_path / "out"
    cp = hsbuild("export", build, out, "--format", "modelopt", "--no-progress")
    assert cp.returncode == 1, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    assert "Traceback" not in cp.stderr and "4 selected sample(s) NOT in the export" in cp.stderr, cp.stderr
    for sid in ("s0002", "s0006", "s0008", "s0009"):
        assert sid in cp.stderr
    assert f"hsbuild verify {build}" in cp.stderr and f"hsbuild resume {build}" in cp.stderr
    j = journal(out)
    assert not j["complete"] and j["finished"]
    assert [(d["sample_id"], d["state"]) for d in j["report"]["not_exported"]] == \
        [("s0008", "pending"), ("s0009", "pending"), ("s0002", "damaged"), ("s0006", "damaged")]
    assert sorted(j["files"]) == [f"s{i:04d}" for i in (0, 1, 3, 4, 5, 7)]
    with EventLog(layout(build).events, read_only=True) as log:
        (d,) = [json.loads(r["detail"]) for r in log.query_dicts("SELECT detail FROM events WHERE kind='export'")]
    assert d["not_exported"] == 4 and sorted(d["not_exported_ids"]) == ["s0002", "s0006", "s0008", "s0009"]
    assert sorted(d["damaged"]) == ["s0002", "s0006"] and d["complete"] is False

    again = export_cli(build, out, "modelopt")  # the same export again, nothing repaired: still named
    assert again[0] == 1 and again[1]["exported"] == 0 and len(again[1]["not_exported"]) == 4

    cli_ok("verify", build, rc=1)
    cli_ok("resume", build)
    rc, rep, err = export_cli(build, out, "modelopt")
    assert rc == 0, err
    assert rep["added"] == ["s0002", "s0006", "s0008", "s0009"] and rep["already"] == 6 and rep["complete"]
    assert rep["not_exported"] == [] and rep["rows"] == 10
    fresh = tmp_path / "fresh"
    assert export_cli(build, fresh, "modelopt")[0] == 0
    assert_same_tree(out, fresh, "after the repair")
    assert_trainer_reads(build, out, "modelopt", "after the repair")


def test_a_sample_whose_tokens_are_damaged_leaves_the_export_and_comes_back(make_build, tmp_path):
    """A kept file's sample is not read again, but its tokens are (the dataset-wide files need them): damaged
    there, the sample is named and its file removed, exit 1; repaired, it is back at its row."""
    build = make_build(rows=random_rows(6, seed=9, lo=35, hi=48), codec="none", chunk_tokens=16,
                       final_state="pre_norm")
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    out = tmp_path / "out"
    export_build(build, out, ExportOptions(format="speculators"))
    flip_byte(build, samples(build)["s0003"], "input_ids")
    cli_ok("skip", build, "s0000", "--reason", "test")  # something to do: the others renumber
    rc, rep, err = export_cli(build, out, "speculators")
    assert rc == 1 and [(d["sample_id"], d["state"]) for d in rep["not_exported"]] == [("s0003", "damaged")], err
    assert rep["removed"] == ["s0000", "s0003"] and rep["rows"] == 4
    assert_rows_match_files(build, out, "speculators")
    assert_trainer_reads(build, out, "speculators", "tokens damaged")
    cli_ok("verify", build, rc=1)
    cli_ok("resume", build)
    rc, rep, err = export_cli(build, out, "speculators")
    assert rc == 0 and rep["added"] == ["s0003"], err
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="speculators"))
    assert_same_tree(out, fresh, "after the repair")


# -- 4. a full volume: exit 3 in one line, then the export finishes --------------------------------------------------

def test_full_volume_mid_export_exits_3_in_one_line_and_finishes_after_space_returns(make_build, tmp_path):
    """A tmpfs whose inodes run out mid-export (the watermarks see bytes, not inodes: the kernel says ENOSPC)."""
    build = make_build(rows=random_rows(40, seed=6, lo=5, hi=30))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 40
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="specforge", draft_vocab_size=16))
    with mounted_tmpfs(tmp_path / "vol", "24m,nr_inodes=200") as vol:
        filler = vol / "filler"
        filler.mkdir()
        free = os.statvfs(vol).f_favail
        for i in range(free - 20):  # room for about 15 sample files
            (filler / str(i)).touch()
        out = vol / "out"
        cp = hsbuild("export", build, out, "--format", "specforge", "--draft-vocab-size", "16", "--no-progress")
        assert cp.returncode == 3, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
        lines = cp.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hsbuild export: error:") and "full" in lines[0], cp.stderr
        assert "run the same command again" in lines[0]
        written = list(out.rglob("data_*.ckpt"))
        assert 0 < len(written) < 40, len(written)
        assert not [p for p in out.rglob("*") if p.name.endswith(TMP_SUFFIX) or p.name.endswith(".tmp")]
        assert not journal(out)["finished"]

        shutil.rmtree(filler)  # space returns
        rc, rep, err = export_cli(build, out, "specforge", "--draft-vocab-size", "16")
        assert rc == 0 and rep["complete"] and rep["rows"] == 40 and rep["already"] + rep["exported"] == 40, err
        assert_same_tree(out, fresh, "after space returned")


def test_volume_filling_between_the_check_and_the_write(make_build, tmp_path, monkeypatch):
    """Bytes this time: another writer fills the volume after the watermark check (here: the check is skipped),
    so the write itself gets ENOSPC. One DiskFullError (exit 3); a re-run after space returns finishes, and a
    temp journal left over (an interrupted first write) does not make OUT "not an hsbuild export"."""
    build = make_build(rows=random_rows(30, seed=7, lo=40, hi=60), final_state="pre_norm")
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 30
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="speculators"))
    per_file = max(len(b) for b in tree(fresh).values())
    roomy = Watermarks(low=1.0, high=1.0, flood=1.0)
    with mounted_tmpfs(tmp_path / "vol", "4m") as vol:
        out = vol / "out"
        # a first journal write that never finished: only its temp file is there
        out.mkdir()
        (out / (JOURNAL + TMP_SUFFIX)).write_bytes(b'{"hsbuild_export": 2, "fil')
        (out / f".{JOURNAL}.12345.tmp").write_bytes(b"{")
        st = os.statvfs(vol)
        filler = vol / "filler.bin"
        filler.write_bytes(b"\xff" * (st.f_bavail * st.f_frsize - 12 * per_file))  # room for a dozen files
        monkeypatch.setattr(export_space, "wait_for_space", lambda *a, **k: 0)
        with pytest.raises(DiskFullError, match="volume is full") as e:
            export_build(build, out, ExportOptions(format="speculators", allow_overcommit=True, watermarks=roomy))
        assert len(str(e.value).splitlines()) == 1
        assert 0 < len(list((out / "hidden_states").iterdir())) < 30
        assert not [p for p in out.rglob("*") if p.name.endswith(TMP_SUFFIX) or p.name.endswith(".tmp")]

        filler.unlink()
        (out / (JOURNAL + TMP_SUFFIX)).write_bytes(b"{")  # and a temp journal left by a kill, this time
        rep = export_build(build, out, ExportOptions(format="speculators", allow_overcommit=True, watermarks=roomy))
        assert rep.complete and rep.rows == 30 and rep.already >= 1
        assert_same_tree(out, fresh, "after space returned")


def test_a_folder_holding_only_a_temp_journal_is_a_new_export(make_build, tmp_path):
    build = make_build(rows=random_rows(3, seed=2, lo=5, hi=10))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 3
    out = tmp_path / "out"
    out.mkdir()
    (out / (JOURNAL + TMP_SUFFIX)).write_bytes(b"{")
    rep = export_build(build, out, ExportOptions(format="modelopt"))
    assert rep.complete and rep.rows == 3
    assert not (out / (JOURNAL + TMP_SUFFIX)).exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not an hsbuild export"):
        export_build(build, tmp_path / "other", ExportOptions(format="modelopt"))
