"""What a re-run of an export keeps is what it proved: a kept file matches the checksum its journal recorded
(a damaged one is written again and named).

Real builds (the small built-in model), the real CLI.
"""

from __future__ import annotations

from pathlib import Path

from conftest import hsbuild, random_rows
from test_export_reconcile import assert_same_tree, export_cli, journal

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
