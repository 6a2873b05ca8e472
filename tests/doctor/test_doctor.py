"""`hsbuild doctor` and the run preflight.

There is no GPU on this machine or in CI: GPU scenarios fake NVML at its one boundary (`builder.doctor.gpu._nvml`,
see tests/fake_nvml.py), torch's CUDA probe at `builder.doctor_checks.cuda_probe`, and the systemd unit at the
cgroup reader (a cgroup text fixture). The GPU processes are real live processes (`sleep`) spawned here, so
command lines and parent chains come from the real /proc. Everything else is real: files, DuckDB, the CLI in
subprocesses, a run SIGKILLed mid-way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from conftest import mounted_tmpfs
from fake_nvml import FakeGpu, FakeNVML, GiB, seed_gpus, unit_cgroup

from builder import procfs
from builder.cli.app import main as cli_main
from builder.config import load_config
from builder.doctor import checks as doctor_checks
from builder.doctor import gpu, procinfo
from builder.doctor import storage as doctor_storage
from builder.doctor.report import preflight_for_run, render_lines, run_doctor
from builder.errors import EXIT_PREFLIGHT, PreflightError, QueryError
from builder.layout import layout
from builder.log.events import Event, EventLog, detail
from builder.log.lock import inspect_lock
from builder.log.query import run_query

UNIT = "vllm-kimi-k25-int4.service"
STOP = f"systemctl stop {UNIT} && systemctl disable {UNIT}"


@pytest.fixture
def spawn():
    """spawn(*argv) -> pid of a real process that is not our descendant (its parent exits at once, as a
    service's processes descend from systemd, not from us); killed at the end of the test."""
    pids: list[int] = []

    def start(*argv: str) -> int:
        out = subprocess.run(["sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *argv],
                             capture_output=True, text=True, check=True).stdout
        pids.append(int(out))
        return pids[-1]

    yield start
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fake_gpu_env(monkeypatch, nvml: FakeNVML | None, cuda: bool = True, count: int = 8) -> None:
    """Substitute NVML (None: not installed) and torch's CUDA probe."""
    if nvml is None:
        def missing():
            raise ImportError("No module named 'pynvml'")

        monkeypatch.setattr(gpu, "_nvml", missing)
    else:
        monkeypatch.setattr(gpu, "_nvml", lambda: nvml)
    desc = "torch 2.5.1 (CUDA 12.4)" if cuda else "torch 2.5.1 (CPU-only build)"
    monkeypatch.setattr(doctor_checks, "cuda_probe", lambda: (cuda, count if cuda else 0, desc))


def cgroups_for(pids: set[int], unit: str = UNIT):
    return lambda pid: unit_cgroup(unit) if pid in pids else "0::/user.slice/user-1000.slice/session-3.scope\n"


def by_name(report) -> dict:
    return {c.name: c for c in report.checks}


# ---------------------------------------------------------------------------------------------------
# NVML missing
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["import_error", "library_not_found"])
def test_no_nvml_means_cpu_mode_fine_for_cpu_blocking_for_cuda(make_build, monkeypatch, how):
    nvml = None if how == "import_error" else FakeNVML(library_missing=True)
    fake_gpu_env(monkeypatch, nvml, cuda=False)
    assert gpu.gpu_stats() == []
    inv = gpu.inventory()
    assert not inv.available and inv.reason

    cpu = run_doctor(layout(make_build(n=5, name="cpu", device="cpu")), probe=False)
    checks = by_name(cpu)
    assert checks["gpu"].status == "ok" and "CPU mode" in checks["gpu"].summary
    assert [c.name for c in cpu.checks if "CPU mode" in c.summary] == ["gpu"]  # said once
    assert not cpu.problems and not cpu.gpu_build

    auto = run_doctor(layout(make_build(n=5, name="auto", device="auto")), probe=False)
    assert by_name(auto)["gpu"].status == "ok" and not auto.gpu_build

    cuda = run_doctor(layout(make_build(n=5, name="cuda", device="cuda")), probe=False)
    g = by_name(cuda)["gpu"]
    assert g.status == "fail" and "CPU mode" in g.summary and "--device cpu" in g.fix
    assert [c.name for c in cuda.problems] == ["gpu"]


# ---------------------------------------------------------------------------------------------------
# The seed: eight GPUs held by a systemd service
# ---------------------------------------------------------------------------------------------------


def test_eight_gpus_held_by_a_systemd_service(make_build, monkeypatch, spawn):
    pids = [spawn("sleep", "60") for _ in range(8)]
    fake_gpu_env(monkeypatch, FakeNVML(seed_gpus(pids)))
    lay = layout(make_build(n=5, device="cuda"))

    report = run_doctor(lay, record=True, cgroup_reader=cgroups_for(set(pids)))
    checks = by_name(report)
    assert report.gpu_build and report.status == "fail"
    g = checks["gpu"]
    assert g.status == "fail" and UNIT in g.summary and g.fix == STOP
    assert g.data["foreign"][0]["pids"] == pids and g.data["foreign"][0]["gpus"] == list(range(8))
    for i, pid in enumerate(pids):
        d = checks[f"gpu{i}"]
        assert d.status == "fail" and d.fix == STOP and "75.8 GiB" in d.summary
        proc = d.data["processes"][0]
        assert proc["pid"] == pid and proc["unit"] == UNIT and not proc["ours"]
        assert proc["cmdline"] == "sleep 60" and proc["name"] == "/usr/bin/python3" and proc["stop"] == STOP
        assert d.details == [f"pid {pid} [{UNIT}] 75.8 GiB: sleep 60"]

    text = "\n".join(render_lines(report))
    assert f"fix: {STOP}" in text and text.count(STOP) == 1 and "fix: as for gpu" in text
    assert text.splitlines()[1].startswith("OK") and "FAIL  gpu " in text

    # the run's preflight refuses, records the finding, and names the fix
    cfg = load_config(lay)
    with EventLog(lay.events) as log:
        with pytest.raises(PreflightError) as ei:
            preflight_for_run(lay, cfg, log, force=False, own_pids={os.getpid()}, run_id="r1",
                              cgroup_reader=cgroups_for(set(pids)), probe=False)
        assert ei.value.exit_code == EXIT_PREFLIGHT == 4
        msg = str(ei.value)
        assert STOP in msg and "--force" in msg and msg.count(STOP) == 1 and "(also gpu0, gpu1," in msg
        assert msg.startswith("1 blocking preflight problem in ")
        # --force proceeds, and says so in the record
        forced = preflight_for_run(lay, cfg, log, force=True, own_pids={os.getpid()}, run_id="r2",
                                   cgroup_reader=cgroups_for(set(pids)), probe=False)
        assert forced.forced and forced.problems
        rows = log.query("SELECT run_id, reason, detail FROM events WHERE kind = 'doctor' ORDER BY seq")[1]
    assert [(r[0], r[1]) for r in rows] == [(report.run_id, "fail"), ("r1", "fail"), ("r2", "fail")]
    d2 = json.loads(rows[2][2])
    assert d2["forced"] is True and d2["context"] == "run" and d2["mode"] == "gpu"

    # the same through the CLI (in-process, so the fakes apply): exit code 4, the unit and the command
    monkeypatch.setattr(procinfo, "read_cgroup_text", cgroups_for(set(pids)))
    assert cli_main(["doctor", str(lay.root), "--no-probe"]) == EXIT_PREFLIGHT


def test_foreign_gpu_memory_on_a_cpu_build_is_no_problem(make_build, monkeypatch, spawn):
    pid = spawn("sleep", "60")
    fake_gpu_env(monkeypatch, FakeNVML(seed_gpus([pid])), cuda=True, count=1)
    report = run_doctor(layout(make_build(n=5, device="cpu")), probe=False, cgroup_reader=cgroups_for({pid}))
    checks = by_name(report)
    assert not report.problems and not report.gpu_build
    assert checks["gpu0"].status == "ok" and "CPU build" in checks["gpu0"].summary


def test_our_own_workers_are_not_foreign(make_build, monkeypatch, spawn):
    """A process whose parent chain reaches one of our pids (a worker of the run) is ours."""
    run = spawn("sh", "-c", "sleep 60 & wait")  # a coordinator and its worker, not descendants of pytest
    worker = _wait_for_child(run)
    stranger = spawn("sleep", "61")
    gpus = [FakeGpu(used=70 * GiB, procs=[(worker, 70 * GiB, "python")]),
            FakeGpu(used=60 * GiB, procs=[(run, 60 * GiB, "python")]),
            FakeGpu(used=GiB // 2, procs=[(stranger, GiB // 4, "sleep")])]  # small: below the threshold
    fake_gpu_env(monkeypatch, FakeNVML(gpus), count=3)
    lay = layout(make_build(n=5, device="cuda"))
    cfg = load_config(lay)
    with EventLog(lay.events) as log:
        report = preflight_for_run(lay, cfg, log, force=False, own_pids={run}, probe=False,
                                   cgroup_reader=cgroups_for(set()))
    checks = by_name(report)
    assert not report.problems, render_lines(report)
    assert checks["gpu0"].data["processes"][0]["ours"] and checks["gpu0"].data["foreign_bytes"] == 0
    assert checks["gpu1"].data["processes"][0]["ours"]
    assert checks["gpu2"].status == "ok" and "1 small foreign process" in checks["gpu2"].summary
    assert checks["gpu2"].data["processes"][0]["stop"] == f"kill {stranger}"  # no unit: kill the pid


def _wait_for_child(ppid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and procfs.parent_pid(int(entry.name)) == ppid:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no child of {ppid} appeared")


def test_a_gpu_that_errors_on_query_warns(make_build, monkeypatch):
    gpus = [FakeGpu(util=37), FakeGpu(fail={"memory"}), FakeGpu()]
    fake_gpu_env(monkeypatch, FakeNVML(gpus), count=3)
    report = run_doctor(layout(make_build(n=5, device="cuda")), probe=False)
    checks = by_name(report)
    assert checks["gpu1"].status == "warn" and "query failed" in checks["gpu1"].summary
    assert "memory" in checks["gpu1"].summary and "nvidia-smi" in checks["gpu1"].fix
    assert checks["gpu0"].status == checks["gpu2"].status == checks["gpu"].status == "ok"
    assert not report.problems
    stats = gpu.gpu_stats()
    assert [s["index"] for s in stats] == [0, 1, 2]
    assert stats[0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "util_percent": 37, "mem_used": 512 << 20,
                        "mem_total": 81559 << 20}
    assert stats[1]["mem_used"] is None and stats[1]["mem_total"] is None

    # the coordinator's sampler, and the SQL docs/doctor.md gives for its `gpu_stats` events
    t = [0.0]
    sampler = gpu.GpuSampler(interval=5.0, clock=lambda: t[0])
    assert sampler.poll() == stats and sampler.poll() is None
    t[0] = 5.0
    assert sampler.poll() == stats
    with EventLog(layout(report.build).events) as log:
        log.append([Event("gpu_stats", run_id="r", detail=detail(devices=stats))])
        rows = log.query(GPU_STATS_SQL)[1]
    assert rows[0][1:] == (0, 37, 512 << 20, 81559 << 20) and rows[1][3] is None and len(rows) == 3
    monkeypatch.setattr(gpu, "_nvml", lambda: FakeNVML(library_missing=True))
    quiet = gpu.GpuSampler()
    assert quiet.poll() is None and not quiet.enabled


GPU_STATS_SQL = """
SELECT ts, d.index, d.util_percent, d.mem_used, d.mem_total
FROM (SELECT ts, unnest(from_json(detail->'devices',
        '[{"index":"INTEGER","util_percent":"INTEGER","mem_used":"BIGINT","mem_total":"BIGINT"}]')) AS d
      FROM events WHERE kind = 'gpu_stats')
ORDER BY ts, d.index
"""


# ---------------------------------------------------------------------------------------------------
# /proc and /proc/mounts parsing
# ---------------------------------------------------------------------------------------------------


def test_systemd_unit_from_cgroup_texts():
    parse = procinfo.systemd_unit_from_cgroup
    assert parse(f"0::/system.slice/{UNIT}\n").stop_command() == STOP
    v1 = f"12:pids:/system.slice/{UNIT}\n1:name=systemd:/system.slice/{UNIT}\n"
    assert parse(v1).name == UNIT
    user = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n"
    assert parse(user).stop_command() == "systemctl --user stop jupyter.service && systemctl --user disable " \
                                         "jupyter.service"
    assert parse("0::/user.slice/user-1000.slice/session-3.scope\n") is None  # a login: kill the pid
    assert parse("0::/user.slice/user-1000.slice/user@1000.service/init.scope\n") is None
    assert parse("0::/\n") is None
    me = procinfo.describe(os.getpid(), own_pids={os.getpid()})
    assert me.visible and me.ours and me.cmdline and me.name
    assert procinfo.is_ours(os.getpid(), {os.getppid()})
    gone = procinfo.describe(2**22 + 12345)
    assert not gone.visible and gone.cmdline is None and gone.stop_command() == f"kill {2**22 + 12345}"


def test_filesystem_type_by_longest_mount_prefix(make_build):
    lay = layout(make_build(n=3))
    root = os.path.realpath(lay.root)
    mounts = ("/dev/vda / ext4 rw 0 0\n"
              f"tmpfs {root} tmpfs rw 0 0\n"
              f"/dev/sdb {root}x xfs rw 0 0\n")  # a sibling with a common string prefix does not count
    ctx = doctor_checks.Context(lay, load_config(lay), "cpu", set(), for_run=False)
    c = doctor_storage.check_filesystem(ctx, mounts)
    assert c.status == "warn" and "volatile" in c.summary and c.data["fstype"] == "tmpfs"
    c = doctor_storage.check_filesystem(ctx, "/dev/vda / ext4 rw 0 0\nceph:/vol /mnt/cephfs ceph rw 0 0\n")
    assert c.status == "ok" and c.data["mount_point"] == "/"
    assert doctor_storage.mount_of(Path("/a b/c"), "/dev/x /a\\040b xfs rw 0 0\n").fstype == "xfs"


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro
30 22 0:27 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=1024k
40 22 0:50 / /mnt/nfs4 rw,relatime shared:10 - nfs4 srv:/export rw,vers=4.2,hard,proto=tcp,local_lock=none,addr=10.0.0.2
41 22 0:51 / /mnt/nolock rw,relatime shared:11 - nfs srv:/export rw,vers=3,nolock,proto=tcp,local_lock=all,addr=10.0.0.2
42 22 0:52 / /mnt/nfsflock rw,relatime shared:12 - nfs srv:/export rw,vers=3,proto=tcp,local_lock=flock,addr=10.0.0.2
43 22 0:53 / /mnt/nfsplain rw,relatime shared:13 - nfs srv:/export rw,vers=3
44 22 0:54 / /lustre/ok rw,relatime shared:14 - lustre 10.0.0.3@o2ib:/fs rw,flock,lazystatfs
45 22 0:55 / /lustre/local rw,relatime shared:15 - lustre 10.0.0.3@o2ib:/fs rw,localflock,lazystatfs
46 22 0:56 / /lustre/none rw,relatime shared:16 - lustre 10.0.0.3@o2ib:/fs rw,lazystatfs
47 22 0:57 / /mnt/s3 rw,nosuid,nodev,relatime shared:17 - fuse.s3fs s3fs rw,user_id=0,group_id=0
48 22 0:58 / /mnt/ceph rw,relatime shared:18 - ceph 10.0.0.4:6789:/ rw,name=admin,acl
49 22 0:59 / /mnt/my\\040data rw,relatime shared:19 - xfs /dev/sdb rw,attr2
50 22 0:60 / /mnt/btrfs rw shared:20 - btrfs /dev/sdc rw
51 22 0:61 / /mnt/weird rw shared:21 - weirdfs none rw
"""


@pytest.mark.parametrize("path, status, fstype, words", [
    ("/home/u/build", "ok", "ext4", "local"),
    ("/dev/shm/build", "ok", "tmpfs", "local"),
    ("/mnt/my data/build", "ok", "xfs", "local"),
    ("/mnt/btrfs/b", "ok", "btrfs", "local"),
    ("/mnt/nfs4/build", "ok", "nfs4", "forwarded to the server"),
    ("/mnt/nolock/build", "fail", "nfs", "nolock"),
    ("/mnt/nfsflock/build", "fail", "nfs", "local_lock=flock"),
    ("/mnt/nfsplain/build", "warn", "nfs", "may be local"),
    ("/lustre/ok/build", "ok", "lustre", "coherent"),
    ("/lustre/local/build", "fail", "lustre", "localflock"),
    ("/lustre/none/build", "fail", "lustre", "not supported"),
    ("/mnt/s3/build", "warn", "fuse.s3fs", "FUSE"),
    ("/mnt/ceph/build", "warn", "ceph", "CephFS"),
    ("/mnt/weird/b", "warn", "weirdfs", "unknown"),
])
def test_lock_safety_by_filesystem_and_mount_options(make_build, tmp_path, path, status, fstype, words):
    lay = layout(make_build(n=3))
    ctx = doctor_checks.Context(layout(path), load_config(lay), "cpu", set(), for_run=False)
    c = doctor_storage.check_locking(ctx, MOUNTINFO)
    assert (c.name, c.status, c.data["fstype"]) == ("storage.locking", status, fstype)
    assert words in c.summary, c.summary
    assert (c.fix is None) == (status == "ok")


def test_lock_safety_on_a_real_tmpfs_is_ok(make_build, tmp_path):
    lay = layout(make_build(n=3))
    with mounted_tmpfs(tmp_path / "vol", "1m") as mnt:
        ctx = doctor_checks.Context(layout(mnt / "build"), load_config(lay), "cpu", set(), for_run=False)
        c = doctor_storage.check_locking(ctx)  # this machine's /proc/self/mountinfo
        assert c.status == "ok" and c.data["fstype"] == "tmpfs" and c.data["mount_point"] == str(mnt), c
    report = run_doctor(lay)  # part of every doctor report
    assert by_name(report)["storage.locking"].data["fstype"]


# ---------------------------------------------------------------------------------------------------
# Build state
# ---------------------------------------------------------------------------------------------------


def test_started_and_failed_samples_and_changed_config(make_build, monkeypatch):
    fake_gpu_env(monkeypatch, None, cuda=False)
    lay = layout(make_build(n=10, staging=None))
    with EventLog(lay.events) as log:
        ids = sorted(log.registered())
        log.append([Event("started", run_id="crashed", sample_id=s, attempt=1) for s in ids[:3]]
                   + [Event("started", run_id="crashed", sample_id=s, attempt=1) for s in ids[3:6]]
                   + [Event("failed", run_id="crashed", sample_id=s, attempt=1, reason="nonfinite") for s in ids[3:5]]
                   + [Event("failed", run_id="crashed", sample_id=ids[5], attempt=1, reason="worker_died")])
    report = run_doctor(lay, record=True)
    checks = by_name(report)
    assert checks["build.interrupted"].status == "warn" and checks["build.interrupted"].data["started"] == 3
    assert "hsbuild resume" in checks["build.interrupted"].fix
    f = checks["build.failed"]
    assert f.status == "warn" and f.data["by_reason"] == {"nonfinite": 2, "worker_died": 1}
    assert f.data["to_retry"] == 3 and "nonfinite: 2" in f.summary
    assert checks["build.fingerprint"].status == "ok" and checks["build.lock"].status == "ok"
    assert not report.problems and report.recorded

    # a config change that alters the bytes of a sample, and a model that is not the build's
    cfg_text = lay.config.read_text()
    codec = next(line for line in cfg_text.splitlines() if line.startswith("codec = "))
    lay.config.write_text(cfg_text.replace(codec, 'codec = "zstd:5"'))
    fp = by_name(run_doctor(lay, probe=False))["build.fingerprint"]
    assert fp.status == "fail" and f'(codec {codec.split(" = ")[1]} -> "zstd:5")' in fp.summary
    assert "init NEWDIR" in fp.fix
    assert fp.data["changed_keys"] == ["codec"] and fp.data["overridable"] is False
    lay.config.write_text(cfg_text)
    with EventLog(lay.events) as log:
        log.set_meta({"model_fingerprint": "0123456789abcdef"})
    fp = by_name(run_doctor(lay, probe=False))["build.fingerprint"]
    assert fp.status == "fail" and "model fingerprint" in fp.summary

    # a staging directory that is gone
    lay.config.write_text(cfg_text + "")
    lay.config.write_text(cfg_text.replace("[watermarks]", f'staging = "{lay.root / "gone"}"\n\n[watermarks]'))
    st = by_name(run_doctor(lay))["storage.staging"]
    assert st.status == "fail" and "mkdir -p" in st.fix


def test_doctor_on_this_machine_cpu_mode_and_real_disk(make_build, cli):
    build = make_build(n=8)
    cp = cli("doctor", build, "--json", "--probe", "--record")
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(cp.stdout)
    checks = {c["name"]: c for c in rep["checks"]}
    if checks["gpu"]["data"]["nvml"] or checks["env.torch"]["data"]["cuda_usable"]:
        pytest.skip("this machine has a GPU")
    assert rep["mode"] == "cpu" and rep["status"] in ("ok", "warn") and rep["recorded"]
    assert checks["gpu"]["status"] == "ok" and "CPU mode" in checks["gpu"]["summary"]
    du = shutil.disk_usage(build)
    space = checks["storage.space"]["data"]
    assert space["total_bytes"] == du.total and abs(space["free_bytes"] - du.free) < max(du.total // 100, 64 << 20)
    assert space["projected_bytes"] > 0 and space["fits"]
    probe = checks["storage.probe"]["data"]
    assert probe["bytes"] == 4 << 20 and probe["throughput_bps"] > 0 and probe["fsync_median_s"] >= 0
    assert not list(Path(build).glob(".hsbuild-doctor-probe-*"))
    assert checks["storage.filesystem"]["data"]["fstype"]
    sql = cli("sql", build, "SELECT reason, detail->>'$.mode' AS mode FROM events WHERE kind = 'doctor'", "--json",
              check=True)
    assert json.loads(sql.stdout) == [{"reason": rep["status"], "mode": "cpu"}]
    # the table for people: one line per check
    text = cli("doctor", build, check=True).stdout.splitlines()
    assert text[0].startswith("hsbuild doctor ") and (text[-1] == "all checks OK" or "warning" in text[-1])
    assert any(line.startswith("OK    gpu ") for line in text)
    # an explicit cuda build on a machine without a GPU is blocked
    cp = cli("doctor", build, "--device", "cuda", "--json")
    assert cp.returncode == EXIT_PREFLIGHT and json.loads(cp.stdout)["problems"] >= 1
    # those two wrote nothing: the one recorded report is still the only one
    sql = cli("sql", build, "SELECT count(*) AS n FROM events WHERE kind = 'doctor'", "--json", check=True)
    assert json.loads(sql.stdout) == [{"n": 1}]


@pytest.mark.claim("crash")
def test_stale_lock_from_a_sigkilled_run_is_reported_and_taken_over(make_build, cli, monkeypatch, hold):
    fake_gpu_env(monkeypatch, None, cuda=False)
    lay = layout(make_build(n=12))
    h = hold(5)  # the run is still going at the kill, for certain: its worker holds with its 5th sample started
    run = forked.Popen([sys.executable, "-m", "builder.cli", "run", str(lay.root), "--no-progress"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**h.env, "HSBUILD_GROUP_SAMPLES": "1"})
    try:
        h.wait(proc=run)
        deadline = time.monotonic() + 30
        written = 0
        while written < 3:  # the 4 before it are written (one a group)
            assert run.poll() is None and time.monotonic() < deadline, "the run ended or never got going"
            if inspect_lock(lay).held:
                try:
                    written = run_query(lay, "SELECT count(*) FROM samples WHERE state = 'written'")[1][0][0]
                except QueryError:
                    pass
            time.sleep(0.05)
        # doctor during the run: asks the owner over its socket, does not open the file, records nothing
        live = run_doctor(lay, probe=False)
        checks = by_name(live)
        assert checks["build.lock"].status == "ok" and checks["build.lock"].data["pid"] == run.pid
        assert checks["build.interrupted"].data["live"] and not live.recorded and not live.problems
        assert run.poll() is None, "the run ended before it could be killed"
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
    st = inspect_lock(lay)
    assert st.stale and st.info["pid"] == run.pid

    cp = cli("doctor", lay.root, "--json", "--no-probe")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    lock = {c["name"]: c for c in json.loads(cp.stdout)["checks"]}["build.lock"]
    assert lock["status"] == "warn" and lock["data"]["pid"] == run.pid and not lock["data"]["pid_alive"]
    assert lock["data"]["safe_to_take_over"] and "safe to take over" in lock["summary"]
    assert f"pid {run.pid}" in lock["summary"] and "dead" in lock["summary"]
    assert inspect_lock(lay).info["pid"] == run.pid  # doctor left the dead owner's record in place

    nxt = cli("run", lay.root, "--limit", "5", "--no-progress")
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    prev = cli("sql", lay.root, "SELECT detail->>'$.previous_owner.pid' AS pid FROM events WHERE kind = "
               "'run_started' ORDER BY seq DESC LIMIT 1", "--json", check=True)
    assert json.loads(prev.stdout) == [{"pid": str(run.pid)}]
    assert not inspect_lock(lay).info  # a clean exit empties the lock file
