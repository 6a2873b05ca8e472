"""A Ray node's preflight (builder/run/ray_pool.node_preflight), run here as it runs on each node: it writes a
probe file into the build directory, tries to take the build lock (which must be busy while a run holds it:
taken, it would not keep a second run on that node out), and runs doctor's GPU checks. Without Ray: the
function is what the node's actor calls."""

from __future__ import annotations

from builder.layout import layout
from builder.log.lock import BuildLock
from builder.run.ray_pool import node_preflight


def test_a_held_lock_is_busy_from_another_process(make_build, tmp_path):
    lay = layout(make_build(2))
    with BuildLock(lay, "run"):
        rep = node_preflight(lay.root, lay.root / ".probe-x", "cpu")
    assert rep.write_error is None and (lay.root / ".probe-x").read_text().split()[0] == rep.host
    assert rep.lock_free is False and rep.lock_error is None
    assert [c["status"] for c in rep.gpu_checks] == ["ok"]  # no GPU here: CPU mode, as the build asks


def test_a_lock_nobody_holds_is_reported_free(make_build):
    # what a node on a filesystem whose flock is local to each host sees while the driver holds it
    lay = layout(make_build(2))
    rep = node_preflight(lay.root, lay.root / ".probe-y", "cpu")
    assert rep.lock_free is True
    with BuildLock(lay, "run"):  # and it let the lock go again
        pass


def test_a_directory_the_node_cannot_write_is_named(make_build, tmp_path):
    lay = layout(make_build(2))
    with BuildLock(lay, "run"):
        rep = node_preflight(lay.root, tmp_path / "no-such-dir" / ".probe-z", "cpu")
    assert rep.write_error is not None and "no-such-dir" in rep.write_error
