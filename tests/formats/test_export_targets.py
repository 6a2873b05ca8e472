"""Where an export reads from and writes to, and what it says on the way: no traceback, no hang, no silence.

- an OUT that cannot hold files (/proc, /sys, a path under a file) is refused in one line, exit 2;
- Model-Optimizer's files are named by sample id, and any id `init` accepts fits a file name;
- a build on a read-only mount is exported (an export only reads it), the lock held shared, nothing recorded;
- a pause for space is said on a non-terminal too (which volume, and when it resumes), and the re-run after a
  full volume keeps the files the stopped run wrote, and says how many.

Real builds (the small built-in model), the real CLI, real mounts (tmpfs, a read-only bind mount: root only;
skipped with the reason where they cannot be mounted).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import forked
import pytest
import torch
from conftest import hsbuild, mounted_tmpfs, random_rows
from test_export import assert_all_equal, expected_items, trainer_available
from test_export_reconcile import assert_same_tree, export_cli, journal

from builder.errors import BuildLockedError, UsageError
from builder.exchange.export import ExportOptions, export_build
from builder.formats.modelopt import NAME_BYTES, ModelOpt
from builder.layout import layout
from builder.log.events import EventLog
from builder.log.lock import BuildLock
from builder.run.coordinator import RunOptions, run_build


def one_error_line(cp: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in cp.stderr, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsbuild export: error: "), cp.stderr
    return lines[0]


# -- 1. an OUT that cannot hold an export ------------------------------------------------------------------------

def test_an_out_on_a_kernel_filesystem_or_under_a_file_is_refused_in_one_line(make_build, tmp_path):
    build = make_build(rows=random_rows(2, seed=1, lo=5, hi=10))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 2
    (tmp_path / "a-file").write_text("x")
    for out, says in (("/proc/hsbuild-export", "stores no files"), ("/sys/hsbuild-export", "stores no files"),
                      ("/dev/null/x", "/dev/null is not a directory"),
                      (str(tmp_path / "a-file" / "x"), "a-file is not a directory")):
        if not Path(out).parent.exists():  # (a container without /sys)
            continue
        cp = hsbuild("export", build, out, "--format", "specforge", "--no-progress")
        assert cp.returncode == 2, f"{out}: exit {cp.returncode}\n{cp.stderr}"
        line = one_error_line(cp)
        assert out in line and says in line and "export into a directory" in line, line
    assert not Path("/proc/hsbuild-export").exists()


def test_an_out_that_turns_read_only_mid_export_stops_in_one_line_and_the_rerun_finishes(make_build, tmp_path):
    build = make_build(rows=random_rows(8, seed=5, lo=5, hi=20))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 8
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="specforge"))
    with mounted_tmpfs(tmp_path / "vol", "24m") as vol:
        out, files = vol / "out", [0]

        def remount_after_three() -> bool:  # polled before each file: the volume turns read-only after 3
            files[0] += 1
            if files[0] == 4:
                subprocess.run(["mount", "-o", "remount,ro", str(vol)], check=True)
            return False

        with pytest.raises(UsageError) as e:
            export_build(build, out, ExportOptions(format="specforge", stop=remount_after_three))
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(out) in msg and "Read-only file system" in msg, msg
        subprocess.run(["mount", "-o", "remount,rw", str(vol)], check=True)
        rc, rep, err = export_cli(build, out, "specforge")
        assert rc == 0 and rep["complete"], err
        assert_same_tree(out, fresh, "after the volume was writable again")


# -- 2. Model-Optimizer: any sample id fits a file name ---------------------------------------------------------

def test_modelopt_names_every_accepted_id_within_the_file_name_limit(make_build, tmp_path):
    ids = ["a" * 300, "a" * 300 + "b", "日本語" * 60, "." + "x" * 250, "a/b" * 80, "s0"]
    rows = random_rows(len(ids), seed=2, lo=5, hi=20)
    for r, sid in zip(rows, ids, strict=True):
        r["id"] = sid
    build = make_build(rows=rows)
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == len(ids)
    out = tmp_path / "out"
    rc, rep, err = export_cli(build, out, "modelopt")
    assert rc == 0 and rep["complete"] and rep["rows"] == len(ids), err
    names = sorted(p.name for p in out.glob("*.pt"))
    assert names == sorted(ModelOpt.file_name(sid) for sid in ids) and len(set(names)) == len(ids)
    assert all(len(n.encode()) <= NAME_BYTES and not n.startswith(".") for n in names), names
    assert "s0.pt" in names  # a short id keeps its plain name
    for sid in ids:  # each file says whose it is
        assert torch.load(out / ModelOpt.file_name(sid), weights_only=True)["conversation_id"] == sid
    if trainer_available("modelopt.torch.speculative.eagle.utils"):  # read as its training reads every *.pt
        from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset  # noqa: PLC0415

        files = sorted(str(p) for p in out.rglob("*.pt"))
        ds = OfflineSupervisedDataset(files, answer_only_loss=True)
        got = {torch.load(f, weights_only=True)["conversation_id"]: ds[i] for i, f in enumerate(files)}
        assert_all_equal(got, expected_items(build, "modelopt"), "OfflineSupervisedDataset, long ids")
    rc, rep, err = export_cli(build, out, "modelopt")  # the names are stable: a re-run keeps every file
    assert rc == 0 and rep["exported"] == 0 and rep["already"] == len(ids), err


# -- 3. a build on a read-only mount ---------------------------------------------------------------------------

@contextlib.contextmanager
def read_only_view(src: Path, mnt: Path) -> Iterator[Path]:
    """`src` bind-mounted read-only at `mnt` (root only; skipped with the reason where it cannot be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root; the read-only build test skipped")
    mnt.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount here ({r.stderr.strip()}); the read-only build test skipped")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only here ({r.stderr.strip()}); the read-only build test skipped")
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def stamps(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in root.rglob("*") if p.is_file()}


def export_events(build: Path) -> int:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query("SELECT count(*) FROM events WHERE kind = 'export'")[1][0][0]


def test_a_build_on_a_read_only_mount_is_exported_and_kept_from_owners(make_build, tmp_path):
    build = make_build(rows=random_rows(6, seed=3, lo=5, hi=20))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    before = stamps(build)
    with read_only_view(build, tmp_path / "ro") as ro:
        out = tmp_path / "out"
        cp = hsbuild("export", ro, out, "--format", "modelopt", "--no-progress")
        assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
        assert "Traceback" not in cp.stderr and "6 sample(s) in it; 6 added" in cp.stdout, cp.stdout
        note = cp.stderr.strip().splitlines()
        assert len(note) == 1 and "read-only" in note[0] and "not recorded" in note[0] and str(ro) in note[0], note
        rc, rep, err = export_cli(ro, out, "modelopt")  # and again: kept, the journal at work
        assert rc == 0 and rep["already"] == 6 and rep["exported"] == 0 and rep["recorded"] is False, err

        # the shared lock keeps owners out while it exports, through the writable path too
        refused: list[str] = []

        def try_to_own() -> bool:
            if not refused:
                with pytest.raises(BuildLockedError) as e:
                    BuildLock(layout(build), "run").acquire()
                refused.append(str(e.value))
            return False

        second = tmp_path / "second"
        assert export_build(ro, second, ExportOptions(format="modelopt", stop=try_to_own)).complete
        # ... and the refusal names the reader (this process), not "another process (pid ?)"
        assert refused and "busy" in refused[0] and f"pid {os.getpid()}" in refused[0] and "shared" in refused[0], refused
        assert stamps(build) == before, "the build changed"
        with BuildLock(layout(build), "run"):  # and a live owner makes it busy (exit 5)
            cp = hsbuild("export", ro, tmp_path / "third", "--format", "modelopt", "--no-progress")
            assert cp.returncode == 5 and "busy" in one_error_line(cp), cp.stderr
    assert export_events(build) == 0
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="modelopt"))
    assert_same_tree(out, fresh, "exported from a read-only mount")


# -- 4. full volumes: a pause said on a non-terminal, a re-run that keeps what was written -------------------------

def lines_of(stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_for_line(q: queue.Queue, text: str, seen: list[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"no line with {text!r} on stderr: {seen}")


def test_a_pause_for_space_is_said_on_a_non_terminal_and_its_end_too(make_build, tmp_path):
    build = make_build(rows=random_rows(6, seed=4, lo=5, hi=20))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    with mounted_tmpfs(tmp_path / "vol", "8m") as vol:
        filler = vol / "filler.bin"
        filler.write_bytes(b"\xff" * (6 << 20))  # 75% used: above --high 0.6
        out = vol / "out"
        proc = forked.Popen([sys.executable, "-m", "builder.cli", "export", str(build), str(out), "--format",
                             "specforge", "--no-progress", "--allow-overcommit", "--low", "0.5", "--high", "0.6",
                             "--flood", "0.99"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            q, seen = lines_of(proc.stderr), []
            paused = wait_for_line(q, "PAUSED", seen)
            assert f"tmpfs volume at {vol}" in paused and re.search(r"7\d\.\d% used", paused), paused
            assert "(low 50%, high 60%, flood 99%)" in paused and "resumes by itself" in paused, paused
            assert proc.poll() is None and not (out / "rows_0-2000").exists()  # waiting, nothing written yet
            filler.unlink()
            resumed = wait_for_line(q, "resumed", seen)
            assert str(vol) in resumed, resumed
            assert proc.wait(timeout=120) == 0, "".join(seen)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "paused 1x for space" in proc.stdout.read()
        assert sum("PAUSED" in line for line in seen) == 1, seen


def test_the_rerun_after_a_full_volume_keeps_what_the_stopped_run_wrote(make_build, tmp_path):
    """Inodes run out mid-export (the watermarks see bytes): the journal itself has no room left, so the stopped
    run gives up its last file to save the journal; the re-run keeps every file that journal vouches for."""
    build = make_build(rows=random_rows(40, seed=6, lo=5, hi=30))
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 40
    fresh = tmp_path / "fresh"
    export_build(build, fresh, ExportOptions(format="specforge"))
    with mounted_tmpfs(tmp_path / "vol", "24m,nr_inodes=200") as vol:
        filler = vol / "filler"
        filler.mkdir()
        for i in range(os.statvfs(vol).f_favail - 20):  # room for about 15 sample files
            (filler / str(i)).touch()
        out = vol / "out"
        cp = hsbuild("export", build, out, "--format", "specforge", "--no-progress")
        assert cp.returncode == 3, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
        line = one_error_line(cp)
        kept = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("data_*.ckpt")}
        assert 0 < len(kept) < 40 and f"{len(kept)} kept by its journal" in line, line
        assert sorted(v[0] for v in journal(out)["files"].values()) == sorted(kept)

        shutil.rmtree(filler)
        rc, rep, err = export_cli(build, out, "specforge")
        assert rc == 0 and rep["complete"], err
        assert rep["already"] == len(kept) and rep["exported"] == 40 - len(kept), rep
        assert_same_tree(out, fresh, "after space returned")
