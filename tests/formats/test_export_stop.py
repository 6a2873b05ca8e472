"""Ctrl-C during an export is the owner session's (builder/log/session.py), as for every command that writes: the
first SIGINT stops the export at the next file boundary (Interrupted, exit 130 from the CLI), nothing half-written
is vouched for, and running the same command again finishes it, equal to a fresh export.

Deterministic: the export (in this process, the main thread) sends SIGINT to itself from its own progress
report after its first file, so the stop always lands mid-export, however fast the export is."""

from __future__ import annotations

import os
import signal

import pytest
from test_export_reconcile import assert_same_tree

from builder.errors import Interrupted
from builder.exchange.export import ExportOptions, export_build
from builder.layout import layout
from builder.log.events import EventLog
from builder.progress import NoProgress
from builder.run.coordinator import RunOptions, run_build


class _SigintAfterFirstFile(NoProgress):
    def __init__(self) -> None:
        self.sent = 0

    def update(self, *args, **kwargs) -> None:  # called once a sample's file is written
        if not self.sent:
            self.sent += 1
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_stops_an_export_at_a_file_boundary_and_the_rerun_finishes_it(make_build, tmp_path):
    build = make_build(n=12)
    assert run_build(build, RunOptions(workers=1), echo=lambda _m: None).exit_code == 0
    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGINT)
    progress = _SigintAfterFirstFile()
    with pytest.raises(Interrupted, match="run the same command again"):
        export_build(build, out, ExportOptions(format="specforge", progress=progress))
    assert progress.sent == 1
    assert signal.getsignal(signal.SIGINT) is before  # the session gave the handler back
    files = [p for p in out.rglob("*.ckpt")]
    assert 1 <= len(files) < 12, files  # stopped after the first file, before the last
    with EventLog(layout(build).events, read_only=True) as log:  # an interrupted export records no `export`
        assert log.query("SELECT count(*) FROM events WHERE kind = 'export'")[1][0][0] == 0
    report = export_build(build, out, ExportOptions(format="specforge"))
    assert report.complete and report.rows == 12
    fresh = export_build(build, tmp_path / "fresh", ExportOptions(format="specforge"))
    assert fresh.rows == 12
    assert_same_tree(out, tmp_path / "fresh", "an export finished after Ctrl-C")
