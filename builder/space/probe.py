"""The build's storage, probed where a stuck call cannot hold the command that asked.

A volume whose writes (and maybe reads) stop returning (a full Ceph pool or thin volume, a gone NFS server) leaves
a process that touches it in state `D`: it cannot be interrupted or killed until the volume answers, and a thread
of ours stuck there would keep this process from exiting as well. So `status`, `sql` and `doctor` (and a run's
preflight write probe) make their first calls on the build's storage in a throwaway child process (`python -I -S
-c`: the standard library only, nothing read from the probed volume but what is probed), which says each step as
it begins and as it ends. The parent waits at most the deadline (`HSBUILD_STALL_S`), then names the step still
pending (what, which path, which filesystem, for how long) and leaves the child behind, to finish once the volume
answers. The probe only reads, except the write step (`write_step`: doctor's `--probe` and `--record`, and a
run's preflight), which writes and fsyncs a file of its own and removes it (also when it was left behind).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import StorageStalledError
from builder.layout import BuildLayout
from builder.log.stall import filesystem_of, stall_limit

WRITE_BYTES = 4 << 20  # the write probe: 4 MiB in 1 MiB blocks, an fsync after each
WRITE_BLOCK = 1 << 20
WRITE_MIN_FREE = 16 * WRITE_BYTES  # below this much free space the write probe is not made (it would take room)
WRITE_PREFIX = ".hsbuild-doctor-probe-"

# What the child runs. Steps: {"op": "stat" | "read" | "statvfs" | "write", "path": ..., "nbytes": ...}; for each it
# prints {"i": N, "begin": true} and then {"i": N, "ok": true, ...} or {"i": N, "ok": false, "errno": E, ...}.
_CHILD = r"""
import json, os, statistics, sys, time
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
def run(step):
    op, path, n = step["op"], step["path"], step.get("nbytes", 0)
    if op == "stat":
        os.stat(path)
        return {}
    if op == "statvfs":
        st = os.statvfs(path)
        return {"free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize,
                "read_only": bool(st.f_flag & os.ST_RDONLY)}
    if op == "read":
        fd = os.open(path, os.O_RDONLY)
        try:
            return {"bytes": len(os.pread(fd, n, 0))}
        finally:
            os.close(fd)
    if op == "write":
        st = os.statvfs(os.path.dirname(path))
        if st.f_bavail * st.f_frsize < step["min_free"]:
            return {"skipped": True, "free_bytes": st.f_bavail * st.f_frsize}
        block = step["block"]
        buf = os.urandom(block)
        fsyncs = []
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(max(1, n // block)):
                os.write(fd, buf)
                t = time.perf_counter()
                os.fsync(fd)
                fsyncs.append(time.perf_counter() - t)
            total = time.perf_counter() - t0
        finally:
            os.close(fd)
            os.unlink(path)
        written = max(1, n // block) * block
        return {"bytes": written, "seconds": round(total, 4),
                "throughput_bps": int(written / total) if total else None,
                "fsync_median_s": round(statistics.median(fsyncs), 5), "fsync_max_s": round(max(fsyncs), 5)}
    raise ValueError(op)
for i, step in enumerate(json.loads(sys.argv[1])):
    say(i=i, begin=True)
    try:
        say(i=i, ok=True, **run(step))
    except OSError as e:
        say(i=i, ok=False, errno=e.errno, error=e.strerror or str(e))
"""

@dataclass
class Step:
    op: str  # 'stat', 'read', 'statvfs', 'write'
    path: str
    nbytes: int = 0

    @property
    def what(self) -> str:
        return {"stat": "lookup", "read": "read", "statvfs": "statfs", "write": "write probe"}[self.op]

    def as_arg(self) -> dict:
        out: dict = {"op": self.op, "path": self.path, "nbytes": self.nbytes}
        if self.op == "write":
            out.update(block=WRITE_BLOCK, min_free=WRITE_MIN_FREE)
        return out


@dataclass
class ProbeResult:
    steps: list[Step]
    results: list[dict] = field(default_factory=list)  # one per finished step: ok, errno/error, figures
    stuck: Step | None = None  # the step still pending at the deadline
    waited_s: float = 0.0  # how long the parent waited
    since: float = 0.0  # time.time() when the stuck step began
    path: str = ""  # the probed build's root (its filesystem is named)

    def result(self, op: str) -> dict | None:
        """The result of the first finished step of kind `op`."""
        return next((r for s, r in zip(self.steps, self.results, strict=False) if s.op == op), None)

    def stall(self) -> dict | None:
        """The stuck step as the owner's stall watch names one (what, path, filesystem, pending_s, since), for
        `status`, `sql` and doctor's `storage.stall`; None when every step returned."""
        if self.stuck is None:
            return None
        return {"what": self.stuck.what, "path": self.stuck.path,
                "filesystem": filesystem_of(self.path or self.stuck.path, resolve=False),
                "pending_s": round(max(time.time() - self.since, 0.0), 1), "since": self.since, "probe": True}


def reader_steps(lay: BuildLayout) -> list[Step]:
    """What a reader (`status`, `sql`, `doctor`) is about to read of the build: its directory, configuration, lock
    record, the log's header and WAL, the owner's socket, and the volume's figures (a missing file answers too)."""
    return [Step("stat", str(lay.root)), Step("read", str(lay.config), 1 << 16), Step("read", str(lay.lock), 4096),
            Step("read", str(lay.events), 4096), Step("stat", str(lay.wal)),
            Step("stat", str(lay.root / "hsbuild.sock")), Step("statvfs", str(lay.root))]


def write_step(directory: Path, nbytes: int = WRITE_BYTES) -> Step:
    """A write of `nbytes` in 1 MiB blocks with an fsync after each, into a file of its own in `directory`,
    removed after (not made when the volume has less than WRITE_MIN_FREE free: `skipped`)."""
    return Step("write", str(Path(directory) / f"{WRITE_PREFIX}{os.getpid()}"), nbytes)


def probe(steps: list[Step], deadline_s: float | None = None, root: Path | str | None = None) -> ProbeResult:
    """Run `steps` in a child process; wait at most `deadline_s` (HSBUILD_STALL_S) for all of them. A step that
    fails (ENOENT, EACCES, EROFS, ENOSPC...) has returned: only one that does not return is `stuck`."""
    limit = stall_limit() if deadline_s is None else deadline_s
    out = ProbeResult(steps, path=str(root or ""))
    t0, began = time.monotonic(), time.time()
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, json.dumps([s.as_arg() for s in steps])],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             cwd="/", close_fds=True, start_new_session=True)
    assert child.stdout is not None
    os.set_blocking(child.stdout.fileno(), False)
    buf, pending = b"", None
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = limit - (time.monotonic() - t0)
            if left <= 0:
                break
            if not sel.select(left):
                continue
            chunk = child.stdout.read()
            if chunk is None:  # (nothing after all)
                continue
            if not chunk:  # EOF: every step answered (or the child failed: what it said is what we know)
                child.stdout.close()
                child.wait()
                return out
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("begin"):
                    pending, began = msg["i"], time.time()
                else:
                    msg.pop("i", None)
                    out.results.append(msg)
                    pending = None
    finally:
        sel.close()
    # the deadline passed with a step pending (or not even begun: the child itself cannot start)
    i = pending if pending is not None else len(out.results)
    out.stuck = steps[min(i, len(steps) - 1)]
    out.waited_s, out.since = time.monotonic() - t0, began
    # left to finish once the volume answers (a write probe then removes its file), reaped by a thread that never
    # holds this process; after this process exits, by init
    child.stdout.close()
    threading.Thread(target=child.wait, name="hsbuild-probe-reaper", daemon=True).start()
    return out


def require_answering(lay: BuildLayout, deadline_s: float | None = None) -> ProbeResult:
    """For a reader (`status`, `sql`): the reads it is about to make of the build, made first by a child within
    `deadline_s` (HSBUILD_STALL_S); StorageStalledError (one line: what, where, for how long) when one of them does
    not return, so the command ends instead of hanging in the kernel."""
    res = probe(reader_steps(lay), deadline_s, lay.root)
    stall = res.stall()
    if stall is not None:
        raise StorageStalledError(
            f"STALLED: {stall['what']} pending {stall['pending_s']:.0f} s on {stall['path']} ({stall['filesystem']}): "
            f"the build's volume does not answer (a full Ceph pool or thin volume, a gone NFS server, a failing "
            f"disk); nothing was read or changed; `hsbuild doctor {lay.root}` names the likely causes; try again "
            "once it answers")
    return res
