"""Small samples are cheap to store: they share write-once shard files in groups, so the disk holds at most 1.5x
their recorded bytes (layout 1 used one file per chunk and field, and a directory per chunk row), and what the
projection says is what the disk holds."""

from __future__ import annotations

import os

from conftest import random_rows

from builder.layout import layout
from builder.log.events import EventLog
from builder.run.coordinator import RunOptions, run_build
from builder.space.capacity import capacity_for


def allocated(root) -> tuple[int, int]:
    """(bytes the files and directories under `root` occupy, number of files)."""
    total, files = os.lstat(root).st_blocks * 512, 0
    for d, dirs, names in os.walk(root):
        for n in dirs + names:
            total += os.lstat(os.path.join(d, n)).st_blocks * 512
        files += len(names)
    return total, files


def test_small_samples_share_files_and_take_at_most_1_5x_their_bytes(make_build, monkeypatch):
    monkeypatch.setenv("HSBUILD_GROUP_SECONDS", "120")  # groups bounded by size here, not by this machine's speed
    n = 1000
    build = make_build(rows=random_rows(n, lo=3, hi=6))
    lay = layout(build)
    estimate = capacity_for(lay)["final_bytes"]
    assert run_build(build, RunOptions()).exit_code == 0

    with EventLog(lay.events, read_only=True) as log:
        (recorded, disk_bytes, done), = log.query(
            "SELECT sum(nbytes), sum(disk_bytes), count(*) FROM samples WHERE state IN ('written', 'verified')")[1]
    assert done == n
    on_disk, files = allocated(lay.data)
    assert on_disk <= 1.5 * recorded, (on_disk, recorded)
    assert files <= n / 10, files  # groups of samples sharing shard files, not files per sample
    # the projection before the run did not promise less than the disk now holds; the measured figure is what
    # the shard files and manifests occupy (the rest: segment metadata and directories)
    assert estimate >= on_disk, (estimate, on_disk)
    assert 0.8 * on_disk <= disk_bytes <= on_disk, (disk_bytes, on_disk)
    after = capacity_for(lay)
    assert after["basis"] == "measured"
