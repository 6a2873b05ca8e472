"""Power-cut tests on a FUSE passthrough that models what a worst-case filesystem keeps (DRAFT).

`PowerCutFS` drives `shared/powercut/lazyfs.py`: everything the program does through MOUNT is applied to
BACKING at once; `crash()` freezes the filesystem (every later request fails with EIO), kills the program's
process groups, and rewrites BACKING to hold exactly what was durable; `remount()` is the rebooted machine.

    def test_init_survives_a_power_cut(powercut, tmp_path):
        fs = powercut("strict")                   # skips with a reason where FUSE is unavailable
        p = fs.popen(["init", "B", "--source", src])  # an hsbuild subprocess, cwd = the mount, own session
        assert p.wait(timeout=120) == 0
        report = fs.crash()                       # power cut; kills every process group popen() started
        fs.remount()
        assert hsbuild("status", fs.path("B")).returncode == 0

Where lazyfs.py comes from (first hit wins):
  $HSBUILD_LAZYFS, then <repo>/shared/powercut/lazyfs.py, then <repo>/../shared/powercut/lazyfs.py
  (a checkout sits beside shared/; in CI a read-only copy of shared/ sits beside the clone).
Only lazyfs.py is read from shared/: BACKING, MOUNT and STATE all live under tmp_path, because shared/ may
have no write bits (STATE must also be on BACKING's filesystem: lazyfs hard-links into it).

Which Python runs the daemon: $HSBUILD_LAZYFS_PYTHON, else sys.executable (the project venv, into which CI
installs mfusepy==3.1.1). Needs: Linux, root (the daemon mounts with allow_other), /dev/fuse, fusermount3
(apt-get install -y fuse3, which also brings libfuse3.so.3 that mfusepy loads), mfusepy. Anything missing
skips the test with the reason; set HSBUILD_REQUIRE_POWERCUT=1 (CI) to make that a failure instead.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import claims
import forked
import pytest

REPO = Path(__file__).resolve().parents[1]  # this file lives in <repo>/tests/
DEFAULT_TIMEOUT = 120


def find_lazyfs() -> Path | None:
    env = os.environ.get("HSBUILD_LAZYFS")
    cands = [Path(env)] if env else []
    cands += [REPO / "shared" / "powercut" / "lazyfs.py", REPO.parent / "shared" / "powercut" / "lazyfs.py"]
    for c in cands:
        if c.is_file() and os.access(c, os.R_OK):  # read-only is fine: it runs as `python lazyfs.py`
            return c.resolve()
    return None


def lazyfs_python() -> str:
    return os.environ.get("HSBUILD_LAZYFS_PYTHON") or sys.executable


@functools.cache
def unavailable_reason() -> str | None:
    """None when a power-cut test can run here, else why not (checked once per session, with a real mount)."""
    if not sys.platform.startswith("linux"):
        return f"power-cut tests need Linux FUSE (platform {sys.platform})"
    if os.geteuid() != 0:
        return "power-cut tests need root (lazyfs mounts with allow_other)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (container without the fuse device: run with --device /dev/fuse)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt-get install -y fuse3)"
    lazyfs = find_lazyfs()
    if lazyfs is None:
        return ("lazyfs.py not found: set HSBUILD_LAZYFS, or put shared/powercut/ beside the repo "
                f"({REPO.parent / 'shared' / 'powercut'})")
    py = lazyfs_python()
    r = subprocess.run([py, "-c", "import mfusepy"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"mfusepy not importable by {py} (pip install mfusepy==3.1.1; needs libfuse3.so.3): {last}"
    # the real test: can this machine mount a FUSE filesystem at all (a container may lack CAP_SYS_ADMIN)?
    import tempfile

    with tempfile.TemporaryDirectory(prefix="powercut-probe-") as d:
        fs = PowerCutFS(Path(d), python=py, lazyfs=lazyfs)
        try:
            fs.mount()
            (fs.mnt / "probe").write_bytes(b"x")
            fs.umount()
        except Exception as e:  # noqa: BLE001 - any failure here means "cannot test here"
            fs.close()
            return f"FUSE mount probe failed: {e}"
    return None


class PowerCutError(RuntimeError):
    """lazyfs itself failed (not the program under test)."""


class PowerCutFS:
    """BACKING + MOUNT + STATE under `tmp_path/name`, and the lazyfs daemon between BACKING and MOUNT."""

    def __init__(self, tmp_path: Path, dirs: str = "strict", name: str = "powercut", python: str | None = None,
                 lazyfs: Path | None = None, threads: bool = False):
        if dirs not in ("strict", "journal"):
            raise ValueError(f"dirs={dirs!r}: use 'strict' (POSIX worst case) or 'journal' (ext4/xfs)")
        self.dirs = dirs
        self.threads = threads  # several FUSE threads: reads, statfs and the control file answer during a stall
        self.python = python or lazyfs_python()
        self.lazyfs = Path(lazyfs) if lazyfs else find_lazyfs()
        if self.lazyfs is None:
            raise PowerCutError("lazyfs.py not found (see find_lazyfs)")
        self.root = Path(tmp_path) / name
        self.backing = self.root / "backing"
        self.mnt = self.root / "mnt"
        self.state = self.root / "state"  # beside BACKING: same filesystem, never inside shared/
        for p in (self.backing, self.mnt):
            p.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        self.stalled = False
        self.report: dict | None = None
        self.pgids: list[int] = []  # process groups started by popen(): they die with the power
        self.procs: list[subprocess.Popen] = []

    # -- lazyfs CLI ---------------------------------------------------------------------------------
    def _lazyfs(self, *args: str, timeout: float = DEFAULT_TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, str(self.lazyfs), *args], capture_output=True, text=True,
                              timeout=timeout)

    def mount(self) -> PowerCutFS:
        """Mount BACKING at MOUNT. Whatever BACKING holds now counts as durable."""
        if self.mounted:
            raise PowerCutError("already mounted")
        r = self._lazyfs("mount", str(self.backing), str(self.mnt), "--dirs", self.dirs, "--state", str(self.state),
                         *(["--threads"] if self.threads else []))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs mount failed ({r.returncode}): {r.stdout.strip()} {r.stderr.strip()}")
        self.mounted = True
        return self

    remount = mount  # after crash(): the rebooted machine sees only the durable state

    def crash(self, killpg: int | list[int] | None = None, timeout: float = DEFAULT_TIMEOUT) -> dict:
        """Cut the power: freeze the filesystem, SIGKILL `killpg` and every group popen() started, restore
        BACKING to its durable state. Returns lazyfs's crash report (vanished, resurrected, reverted, ...)."""
        if not self.mounted:
            raise PowerCutError("crash() while not mounted")
        groups = list(self.pgids) + ([killpg] if isinstance(killpg, int) else list(killpg or []))
        args = ["crash", str(self.mnt), "-v", "--timeout", str(timeout)]
        for g in dict.fromkeys(groups):
            args += ["--killpg", str(g)]
        r = self._lazyfs(*args, timeout=timeout + 30)
        self.mounted = False
        self._reap()
        try:
            self.report = json.loads(r.stdout)
        except ValueError:
            raise PowerCutError(f"lazyfs crash failed ({r.returncode}): {r.stdout[-800:]} {r.stderr[-800:]}") from None
        if r.returncode != 0 or not self.report.get("ok") or self.report.get("model_mismatches"):
            raise PowerCutError(f"lazyfs reported a problem with itself: {json.dumps(self.report)[:1500]}")
        return self.report

    def arm(self, n: int) -> None:
        """Cut the power by itself right after N more mutating operations (then call wait_crash())."""
        r = self._lazyfs("arm", str(self.mnt), str(n))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs arm failed: {r.stdout} {r.stderr}")

    def wait_crash(self, timeout: float = DEFAULT_TIMEOUT) -> dict:
        """After arm(): wait for the power cut, kill popen()'s groups, return the report."""
        path = self.state / "crash_report.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and not os.path.ismount(self.mnt):
                self.mounted = False
                self._kill_groups()
                self.report = json.loads(path.read_text())
                return self.report
            time.sleep(0.02)
        raise PowerCutError(f"no power cut within {timeout}s (status: {self.status()})")

    def sync(self) -> None:
        """Make everything durable now (a working sync(2); FUSE never sees the real one)."""
        r = self._lazyfs("sync", str(self.mnt))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs sync failed: {r.stderr}")

    def stall(self) -> None:
        """From now on writes, fsyncs and namespace changes wait (a full Ceph pool); reads and statfs go on
        (mount with threads=True, else everything waits)."""
        r = self._lazyfs("stall", str(self.mnt))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs stall failed: {r.stdout} {r.stderr}")
        self.stalled = True

    def thaw(self) -> None:
        """The waiting requests go through."""
        r = self._lazyfs("thaw", str(self.mnt))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs thaw failed: {r.stdout} {r.stderr}")
        self.stalled = False

    def status(self) -> dict:
        r = self._lazyfs("status", str(self.mnt))
        return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip()}

    def umount(self) -> None:
        """Clean unmount: BACKING keeps everything (a clean shutdown). Fails (EBUSY) while files are open."""
        if not self.mounted and not os.path.ismount(self.mnt):
            return
        self._kill_groups()
        r = self._lazyfs("umount", str(self.mnt))
        if r.returncode != 0:
            raise PowerCutError(f"lazyfs umount failed: {r.stdout} {r.stderr}")
        self.mounted = False

    def close(self) -> None:
        """Teardown: kill what we started, unmount whatever way works. Never raises."""
        if self.stalled:  # (a process waiting on a stalled request cannot be killed until then)
            try:
                self.thaw()
            except Exception:  # noqa: BLE001
                pass
        self._kill_groups()
        if os.path.ismount(self.mnt):
            try:
                self._lazyfs("umount", str(self.mnt), timeout=30)
            except Exception:  # noqa: BLE001
                pass
            if os.path.ismount(self.mnt):  # files still open, or the daemon hung: lazy unmount
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, timeout=30)
        self.mounted = False

    # -- running programs on the mount -----------------------------------------------------------------
    def path(self, *parts: str | os.PathLike[str]) -> Path:
        return self.mnt.joinpath(*parts)

    def popen(self, args: list[str | os.PathLike[str]], cwd: Path | None = None, **kw) -> subprocess.Popen:
        """Start `hsbuild ARGS` (this interpreter's builder.cli) in its own session, cwd = the mount.
        Its process group is SIGKILLed by crash(). Pass `program=[...]` to run something else."""
        program = kw.pop("program", [sys.executable, "-m", "builder.cli"])
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
        p = forked.Popen([*program, *map(str, args)], cwd=str(cwd or self.mnt), env=env, start_new_session=True,
                         **kw)  # (forked from the test zygote where it can be: tests/forked.py)
        self.pgids.append(p.pid)
        self.procs.append(p)
        return p

    def run(self, args: list[str | os.PathLike[str]], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        """Run `hsbuild ARGS` on the mount to completion (no power cut)."""
        p = self.popen(args, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            self._forget(p)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def _forget(self, p: subprocess.Popen) -> None:
        if p.pid in self.pgids:
            self.pgids.remove(p.pid)
        if p in self.procs:
            self.procs.remove(p)

    def _kill_groups(self) -> None:
        for g in self.pgids:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._reap()

    def _reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdout, p.stderr):
                if f is not None and not f.closed:
                    try:
                        f.close()
                    except OSError:
                        pass
        self.procs.clear()
        self.pgids.clear()

    def __enter__(self) -> PowerCutFS:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_powercut() -> None:
    """The running test is about the power-cut claim (tests/claims.py): skipped with the reason where FUSE is
    unavailable, failed instead where $HSBUILD_REQUIRE_POWERCUT=1 (CI)."""
    claims.touch("power-cut")
    reason = unavailable_reason()
    if reason is not None:
        claims.unavailable("power-cut", reason)


@pytest.fixture
def powercut(tmp_path):
    """powercut(dirs='strict', name='powercut', threads=False) -> a mounted PowerCutFS under tmp_path; unmounted
    (thawed first) at teardown."""
    require_powercut()
    made: list[PowerCutFS] = []

    def make(dirs: str = "strict", name: str = "powercut", threads: bool = False) -> PowerCutFS:
        fs = PowerCutFS(tmp_path, dirs=dirs, name=name, threads=threads)
        made.append(fs)
        return fs.mount()

    yield make
    for fs in made:
        fs.close()
