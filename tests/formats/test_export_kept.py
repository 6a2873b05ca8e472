"""What a re-run of an export keeps is what it proved: a kept file matches the checksum its journal recorded
(a damaged one is written again and named), and a re-run after a kill -9 leaves no folder a fresh export does
not have.

Real builds (the small built-in model), the real CLI (in a subprocess where it is killed).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import forked
from conftest import hsbuild, random_rows
from test_export_reconcile import STAGING, assert_same_tree, cli_ok, export_cli, journal

from builder.exchange.export import ExportOptions, export_build
from builder.run.coordinator import RunOptions, run_build


def flip(path: Path, at: int | None = None) -> None:
    """Flip one byte in the middle of the file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x20
    path.write_bytes(bytes(data))


def test_a_damaged_exported_file_is_written_again_not_kept(make_build, tmp_path):
    build = make_build(rows=random_rows(6, seed=3, lo=20, hi=40))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    for d in (out, fresh):
        assert export_build(build, d, ExportOptions(format="specforge", draft_vocab_size=16)).complete
    sample_file = out / journal(out)["files"]["s0002"][0]
    freq_file = out / "token_freq.pt"
    flip(sample_file)  # same size, one byte off: a size check cannot see it
    flip(freq_file)

    rc, rep, err = export_cli(build, out, "specforge", "--draft-vocab-size", "16")
    assert rc == 0, err
    assert_same_tree(out, fresh, "after a byte flipped in an exported file")
    assert rep["repaired"] == ["s0002"], rep  # named as such: not kept, not a change of the build
    assert rep["added"] == [] and rep["rewritten"] == [] and rep["exported"] == 1 and rep["already"] == 5
    assert rep["complete"] and "token_freq.pt" in rep["files"]

    flip(sample_file)
    cp = hsbuild("export", build, out, "--format", "specforge", "--draft-vocab-size", "16", "--no-progress")
    assert cp.returncode == 0, cp.stderr
    assert "1 repaired" in cp.stdout and "repaired: s0002" in cp.stdout, cp.stdout
    assert_same_tree(out, fresh, "after a second flip")


# The CLI in a subprocess that SIGKILLs itself when it first removes a folder: after its last move, before the
# folders it emptied are gone.
KILL_AT_RMDIR = """
import os, pathlib, signal, sys
from builder.cli.app import main
def rmdir(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
os.rmdir = pathlib.Path.rmdir = rmdir
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_before_emptied_folders_are_removed_then_rerun_leaves_none(make_build, tmp_path):
    build = make_build(rows=random_rows(8, seed=12, lo=5, hi=20), final_state="pre_norm")
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 8
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    export_build(build, out, ExportOptions(format="speculators"))
    cli_ok("skip", build, "s0001", "--reason", "test")  # every later row moves, through the staging folder
    export_build(build, fresh, ExportOptions(format="speculators"))

    cp = forked.run([sys.executable, "-c", KILL_AT_RMDIR, "export", str(build), str(out), "--format",
                     "speculators", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert cp.returncode == -signal.SIGKILL, f"exit {cp.returncode}\n{cp.stderr}"
    assert (out / STAGING).is_dir() and not any((out / STAGING).iterdir())  # killed with the staging folder empty
    rc, rep, err = export_cli(build, out, "speculators")
    assert rc == 0 and rep["complete"], err
    assert_same_tree(out, fresh, "killed before the emptied folders were removed, then run again")
