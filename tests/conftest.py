"""Shared fixtures: small real sources and builds on disk, and the CLI (in this process, or as a real process:
tests/cli_runner.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import claims
import numpy as np
import pytest
import torch
from cli_runner import hsbuild, hsbuild_proc, note_environment  # noqa: F401 (re-exported: `from conftest import hsbuild`)
from powercut_fixture import powercut  # noqa: F401 (the power-cut fixture: tests/durability)
from vllm_fixture import tiny_llama, vllm_server  # noqa: F401 (a real vLLM server: tests/engines)

from builder.config import AUTO_WORKERS, BuildConfig, Watermarks
from builder.extract.model import fix_threading
from builder.layout import layout
from builder.run import testhook
from builder.run.create import init_build

# Builds in tests live on the machine's ordinary disk, whose fill level we do not control: unless a test is
# about watermarks, give them watermarks near 100% so a fairly full CI disk does not pause or refuse them.
# Workers make samples durable in groups (up to 3 s of them by default). Tests that stop, kill or watch a run
# mid-way need a steady stream of `written` events, so in tests a group waits at most this long (the test of
# grouping itself sets its own bound).
os.environ.setdefault("HSBUILD_GROUP_SECONDS", "0.3")
# A run whose vLLM server went away checks for it again at waits doubling up to 30 s; in tests a server comes back
# within seconds, and a run that noticed it up to 30 s late only made the suite slower
os.environ.setdefault("HSBUILD_SERVER_RETRY_MAX", "2")
# Ray (tests/run/test_ray.py): every node of a test cluster, and every driver, on the loopback address only
# (read by Ray when it is imported: set before any test imports it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Reference forward passes in tests compare bit for bit with what workers computed: same threading conditions.
fix_threading()
note_environment()  # calls whose environment changes more than CALL_TIME_ENV get a real CLI process

# between two questions to a live run's owner (wait_written, polls): each one costs that process ~25 ms of CPU
# (a throwaway locked-down DuckDB instance, builder/log/sandbox.py), taken from the run the test watches
POLL_OWNER_S = 0.2
ROOMY = Watermarks(low=0.997, high=0.998, flood=0.999, min_free=0)


class Hold:
    """A run held at a known point by the test hook (builder/run/testhook.py): each of its workers stops at its
    `k`-th task (reported `started`, not yet extracted) until `release()`. Pass `env` to the run (Popen's env, or
    the CLI's `env=`); `wait()` returns once the workers hold: the run is then certainly still going, a sample in
    each held worker's hand and k-1 behind it (with HSBUILD_GROUP_SAMPLES=1: written)."""

    def __init__(self, folder: Path, k: int):
        self.folder, self.k = folder, k
        folder.mkdir(parents=True, exist_ok=True)
        self.spec = f"{k}:{folder}"
        self.env = {**os.environ, testhook.ENV: self.spec}

    @staticmethod
    def together(*holds: Hold) -> dict[str, str]:
        """The environment for a run held by each of `holds` in turn (at its k-th task, then the next's...)."""
        return {**os.environ, testhook.ENV: ";".join(h.spec for h in holds)}

    def wait(self, workers: int = 1, proc: subprocess.Popen | None = None, timeout: float = 240) -> dict[int, int]:
        """{worker number: pid} of the held workers, once `workers` of them hold (AssertionError if the run
        `proc` ended first, or after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            found = {int(p.name.split("-", 1)[1]): int(p.read_text()) for p in self.folder.glob("reached-*")}
            if len(found) >= workers:
                return found
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the run ended (exit {proc.returncode}) before {workers} worker(s) held "
                                     f"at task {self.k}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} of {workers} worker(s) held at task {self.k} after {timeout} s")
            time.sleep(0.02)

    def release(self) -> None:
        """Every held worker goes on (and none holds later)."""
        (self.folder / "gate").touch()


class Watched:
    """A Popen'd process (stdout and stderr pipes, text) whose output is read on threads as it comes: a test
    can wait for a line (`wait_for`) while the process runs, and the pipes never fill."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
                         for s, into in ((proc.stdout, self.out), (proc.stderr, self.err)) if s is not None]
        for t in self._threads:
            t.start()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until a line of stderr holds `text` (AssertionError if the process ends first, or after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.err)):
            if self.proc.poll() is not None:
                for t in self._threads:
                    t.join(5)
                if any(text in line for line in self.err):
                    return
                raise AssertionError(f"exited {self.proc.returncode} without saying {text!r}: {''.join(self.err)}")
            assert time.monotonic() < deadline, f"{text!r} not said within {timeout} s: {''.join(self.err)}"
            time.sleep(0.02)

    def communicate(self, timeout: float = 120) -> tuple[str, str]:
        """Wait for the process to end: (stdout, stderr), as Popen.communicate gives them."""
        self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        return "".join(self.out), "".join(self.err)


@pytest.fixture
def hold(tmp_path):
    """hold(k) -> Hold: a run's workers held at their k-th task (see Hold); released at the test's end."""
    made: list[Hold] = []

    def make(k: int) -> Hold:
        h = Hold(tmp_path / f"hold-{len(made)}", k)
        made.append(h)
        return h

    yield make
    for h in made:
        h.release()


def wait_written(build: Path, k: int, proc: subprocess.Popen | None = None, timeout: float = 240) -> int:
    """Return once the run on `build` has committed `k` `written` events (asked of the running owner), with
    their count; AssertionError if the run `proc` ends first, or after `timeout`."""
    deadline = time.monotonic() + timeout
    n = -1
    while n < k:
        assert proc is None or proc.poll() is None, f"the run ended (exit {proc.returncode}) with {n} written"
        assert time.monotonic() < deadline, f"{n} of {k} samples written after {timeout} s"
        n = written_count(build)
        if n < k:
            time.sleep(POLL_OWNER_S)
    return n


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """`pred()`'s first true value within `timeout` seconds; AssertionError naming `what` at the deadline, or at once
    when `proc` (a run) exits first (with its stderr, when that is a pipe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            err = f": {proc.stderr.read()}" if proc.stderr is not None else ""
            raise AssertionError(f"run exited ({proc.returncode}) while waiting for {what}{err}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def live_count(build: Path, sql: str) -> int:
    """The count `sql` (a `SELECT count(*) ...`) gives on `build` now, asked of the run that owns its log (or read
    from the log when none does); -1 while the owner cannot answer (it may be starting, or gone)."""
    from builder.log.query import run_query  # noqa: PLC0415

    with contextlib.suppress(Exception):
        return run_query(layout(build), sql)[1][0][0]
    return -1


def written_count(build: Path) -> int:
    """`written` events on `build` so far (live_count)."""
    return live_count(build, "SELECT count(*) FROM events WHERE kind = 'written'")


def _live_processes() -> list[tuple[int, str, int, int]]:
    """(pid, name, parent pid, process group) of every live (not zombie) process, from /proc/PID/stat."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, rest = stat.read_text().rpartition(")")
        except OSError:
            continue
        fields = rest.split()
        if len(fields) < 3 or fields[0] == "Z":
            continue
        out.append((int(stat.parent.name), head.partition("(")[2], int(fields[1]), int(fields[2])))
    return out


def worker_pids(root: int) -> list[int]:
    """The live hsbuild workers below process `root` (its children, or the fork server's: workers name themselves
    hsbuild-wN, builder/run/worker_start.py)."""
    from builder.run.worker_start import NAME_PREFIX  # noqa: PLC0415

    procs = _live_processes()
    kids: dict[int, list[int]] = {}
    for pid, _, ppid, _ in procs:
        kids.setdefault(ppid, []).append(pid)
    names = {pid: name for pid, name, _, _ in procs}
    out, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        if names[pid].startswith(NAME_PREFIX):
            out.append(pid)
        todo.extend(kids.get(pid, []))
    return sorted(out)


def process_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return [pid for pid, _, _, pgrp in _live_processes() if pgrp == pgid]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def random_rows(n: int, seed: int = 0, vocab: int = 1024, lo: int = 5, hi: int = 120) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(lo, hi))
        rows.append({"id": f"s{i:04d}", "input_ids": rng.integers(3, vocab, size=k).tolist(),
                     "loss_mask": [0] * (k // 3) + [1] * (k - k // 3)})
    return rows


# Tests that start heavy shared things run one after the other in one xdist worker (pyproject's addopts: -n 2
# --dist loadgroup): the vLLM engine tests share one session server (and start more of their own), and two Ray
# test clusters at once would crowd 2 cores.
XDIST_GROUPS = {"engines": "vllm", "test_ray.py": "ray", "test_node_preflight.py": "ray", "test_vllm_ray.py": "ray"}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    claims.set_current(item)  # its claim markers, and what mounted_tmpfs / powercut say during it


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    claims.set_current(None)


def pytest_configure(config):
    config.addinivalue_line("markers", "claim(kind): the test exercises a crash, power-cut or full-disk claim "
                                       "(tests/claims.py)")


def pytest_runtest_logreport(report):
    claims.TALLY.add(report)  # in the xdist controller: every worker's reports


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller prints the whole run's
        return
    lines = claims.TALLY.lines()
    terminalreporter.section("claims exercised (tests/claims.py)")
    for line in lines:
        terminalreporter.write_line(line)
    out = os.environ.get("HSBUILD_CLAIMS_REPORT")
    if out:
        Path(out).write_text("claims exercised by this test run:\n" + "\n".join(lines) + "\n")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it names them into the node ids)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        group = XDIST_GROUPS.get(path.name) or XDIST_GROUPS.get(path.parent.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _cli_environment():
    """(first of the autouse fixtures) The environment this test starts with: the CLI runs in this process only
    while the test changed nothing in it that a module reads at import (tests/cli_runner.py)."""
    note_environment()


@pytest.fixture(autouse=True)
def _private_weights_cache(tmp_path, monkeypatch):
    """Model-file digests (extract/weights.py) are cached per test, never in the user's ~/.cache."""
    monkeypatch.setenv("HSBUILD_CACHE_DIR", str(tmp_path / "hsbuild-cache"))


@pytest.fixture
def make_build(tmp_path):
    """make_build(n=20, rows=None, workers=1, **init_kwargs) -> build path (initialised, not run). One worker
    unless a test asks for more (`workers=2`, or "auto" as `init` records it): a worker is a process that imports
    torch (about 2 CPU-seconds), and most tests are not about how the workers share a run."""

    def make(n: int = 20, rows: list[dict] | None = None, name: str = "build", seed: int = 0,
             workers: int | str = 1, **kw) -> Path:
        src = write_jsonl(tmp_path / f"{name}-source.jsonl", rows if rows is not None else random_rows(n, seed))
        kw.setdefault("watermarks", ROOMY)
        kw.setdefault("model", "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128")
        root = init_build(tmp_path / name, src, **kw).root
        if workers != AUTO_WORKERS:
            set_config(root, workers=workers)
        return root

    return make


def set_config(build: Path, **settings) -> None:
    """Change settings of the build's hsbuild.toml (e.g. `workers=2`, `engine_args=[...]`), as a user edits it."""
    path = layout(build).config
    cfg = BuildConfig.from_toml(path)
    for key, value in settings.items():
        setattr(cfg, key, value)
    cfg.save(path)


@pytest.fixture
def cli():
    """hsbuild(*args, check=False, timeout=300, cwd=, env=, input=) -> CompletedProcess: the CLI's `main` run in
    this process as a fresh process would run it (tests/cli_runner.py says what it gives, and which calls still
    get a real process)."""
    return hsbuild


@pytest.fixture
def cli_proc():
    """The same, always as a real `python -m builder.cli` process: for what only a process has (signals from
    outside, kill -9, the interpreter's own exit codes, a second owner of a build at once, environment variables
    read at import)."""
    return hsbuild_proc


def fake_nvml_module():
    """tests/doctor/fake_nvml.py, for tests outside tests/doctor (there is no GPU here: NVML is faked at its
    one boundary, `builder.doctor.gpu._nvml`)."""
    import importlib.util  # noqa: PLC0415

    fake = sys.modules.get("fake_nvml")
    if fake is None:
        spec = importlib.util.spec_from_file_location("fake_nvml", Path(__file__).parent / "doctor" / "fake_nvml.py")
        fake = importlib.util.module_from_spec(spec)
        sys.modules["fake_nvml"] = fake
        spec.loader.exec_module(fake)
    return fake


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str, options: str = ""):
    """A real tmpfs of `size` (e.g. "24m") mounted at `mnt` (created), unmounted after. The test is about the
    full-disk claim (tests/claims.py): where it cannot mount (not root, no permission) it is skipped with the
    reason, or fails where $HSBUILD_REQUIRE_TMPFS=1 (CI)."""
    claims.touch("full-disk")
    if os.geteuid() != 0:
        claims.unavailable("full-disk", "mounting a tmpfs needs root (or a user namespace: unshare -Urm, as .ci/run "
                                        "does); tests on a small volume skipped")
    mnt.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{',' + options if options else ''}", "tmpfs",
                        str(mnt)], capture_output=True, text=True)
    if r.returncode:
        claims.unavailable("full-disk", f"cannot mount a tmpfs here ({r.stderr.strip()}); tests on a small volume "
                                        "skipped")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> None:
    """Another process takes every free byte of the volume `path` is on (a file it writes until ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (1 << 20, 64 << 10, 4096, 512):
            buf = b"\xff" * block
            try:
                while True:
                    os.write(fd, buf)
            except OSError:
                pass
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0


def fill_with_log(log, path: Path) -> None:
    """`fill(path)`, then commit to the open EventLog `log` until it says the disk is full (the WAL's last page
    taken too): its next commit certainly fails."""
    from builder.errors import DiskFullError  # noqa: PLC0415
    from builder.log.events import Event  # noqa: PLC0415

    fill(path)
    try:
        while True:
            log.append([Event("gpu_stats", run_id="r", detail="x" * 500)])
    except DiskFullError:
        pass


@pytest.fixture
def tmpfs(tmp_path):
    """A real 24 MB tmpfs mounted at tmp_path/vol (root only; skipped with the reason where it cannot mount)."""
    with mounted_tmpfs(tmp_path / "vol", "24m") as mnt:
        yield mnt


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


# A CPU forward pass is not always reproducible to the last bit across processes: twice in some hundred runs
# (once in CI) a sample's states differed from a fresh forward by one bf16 ulp in a handful of values, with the
# same thread count and MKL_DYNAMIC/OMP_DYNAMIC off. What storage must keep bit-exact is guarded by each
# sample's CRC-32C, computed by the worker from the tensors it got and checked by every read; this comparison
# says the stored states ARE the model's states for these tokens: equal bits, or at most this share of values
# off by at most this many ulps (a lossy conversion, a shifted row or another layer changes far more).
ULP_SLACK, ULP_SHARE = 2, 0.002


def same_states(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    a, b = bits(got).astype(np.int32), bits(ref).astype(np.int32)
    if np.array_equal(a, b):
        return True, ""
    off = a != b
    ulps = np.abs(a - b)[off]
    same_sign = ((a < 0) == (b < 0))[off].all()
    ok = same_sign and int(ulps.max()) <= ULP_SLACK and off.mean() <= ULP_SHARE
    return ok, (f"{int(off.sum())} of {a.size} values differ, by up to {int(ulps.max())} ulp(s), max abs diff "
                f"{(got.float() - ref.float()).abs().max()}")
