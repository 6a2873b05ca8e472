"""doctor's storage checks: the build's filesystem (volatile? network? read-only?), whether its flock excludes
other hosts, free space against the projected need, the staging folder, a stalled volume, and the write probe.

Standalone doctor writes nothing to the build: its storage calls are first made by a child process with a
deadline (builder/space/probe.py), so a volume that does not answer is named (`storage.stall`) instead of holding
doctor in the kernel; the write probe (`storage.probe`) is made only when asked (`doctor --probe`, and a run's
preflight, which owns the build).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from builder.doctor.checks import FAIL, OK, WARN, Check, Context, meta_of
from builder.errors import HsbuildError
from builder.humanize import human_bytes, pct
from builder.log.stall import stall_limit
from builder.mounts import mount_entry, mount_of, parse_mountinfo, system_mounts
from builder.space.capacity import capacity_from
from builder.space.probe import WRITE_BYTES, ProbeResult
from builder.space.watermarks import disk_usage

SLOW_FSYNC_S = 0.2
SLOW_WRITE_BPS = 20e6
VOLATILE_FS = {"tmpfs", "ramfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "lustre", "9p", "gpfs", "beegfs"}


def check_filesystem(ctx: Context, mounts_text: str | None = None) -> Check:
    found = mount_of(ctx.lay.root, mounts_text)
    m = found.as_dict() if found else {"mount_point": None, "fstype": None, "device": None}
    fs = m["fstype"] or "?"
    summary = f"{ctx.lay.root} is on {fs} ({m['device']} at {m['mount_point']})"
    if fs in VOLATILE_FS:
        return Check("storage.filesystem", WARN, summary + ": volatile, lost on reboot",
                     "move the build to a persistent disk (hsbuild init a new build there)", m)
    base = fs.split(".", 1)[0]
    if base in NETWORK_FS or fs.startswith("fuse."):
        summary += "; a network/FUSE filesystem: free space is the client's view"
    return Check("storage.filesystem", OK, summary, data=m)


# Where flock(2) on hsbuild.lock excludes every other owner (docs/design.md, "The build lock").
LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "ramfs", "overlay", "jfs",
            "reiserfs", "nilfs2", "hfsplus", "vfat", "exfat"}


def lock_safety(fstype: str, options: dict[str, str | None]) -> tuple[str, str]:
    """(status, why): does flock(2) on this filesystem exclude owners on every host that mounts it?"""
    base = fstype.split(".", 1)[0]
    if fstype in LOCAL_FS:
        return OK, f"{fstype} is a local filesystem: flock excludes every other process"
    if base in ("nfs", "nfs4"):
        local = options.get("local_lock")
        if "nolock" in options:
            return FAIL, "NFS mounted with nolock: flock is local to each client host"
        if local in ("flock", "all"):
            return FAIL, f"NFS mounted with local_lock={local}: flock is local to each client host"
        if local in ("none", "posix"):
            return OK, f"NFS (local_lock={local}): flock is forwarded to the server as a lock every client sees"
        return WARN, "NFS whose lock options are not shown: flock may be local to each client host"
    if base == "lustre":
        if "localflock" in options:
            return FAIL, "Lustre mounted with localflock: flock is local to each client node"
        if "flock" in options:
            return OK, "Lustre mounted with flock: flock is coherent across client nodes"
        return FAIL, "Lustre without the flock mount option: flock is not supported"
    if base in ("fuse", "fuseblk"):
        return WARN, f"{fstype} (FUSE): whether flock reaches other hosts depends on the filesystem daemon"
    if base == "ceph":
        return WARN, "CephFS (kernel client): flock is coherent across clients through the MDS, but a client " \
                     "evicted by the cluster loses its locks while its process runs on"
    if base in ("cifs", "smb3", "gpfs", "beegfs", "9p", "glusterfs", "ocfs2", "gfs2", "orangefs"):
        return WARN, f"{fstype} is shared between hosts: flock may not exclude a run on another host"
    return WARN, f"unknown filesystem type {fstype}: cannot tell whether flock excludes other hosts"


def check_locking(ctx: Context, mountinfo_text: str | None = None) -> Check:
    """Is the build's filesystem safe for the event log's single-owner lock?"""
    mounts = parse_mountinfo(mountinfo_text) if mountinfo_text is not None else system_mounts()
    m = mount_entry(ctx.lay.root, mounts)
    if m is None:
        return Check("storage.locking", WARN, f"cannot tell which filesystem holds {ctx.lay.root} (no mount table)",
                     "make sure no two hosts run hsbuild on this build at once", {"fstype": None})
    status, why = lock_safety(m.fstype, m.options)
    fix = None
    if status != OK:
        fix = ("keep the build (its events.duckdb and hsbuild.lock) on a local disk, or make sure only one host "
               "ever runs hsbuild on it" + ("; for Lustre mount with -o flock" if m.fstype == "lustre" else "")
               + ("; for NFS mount without nolock/local_lock" if m.fstype.startswith("nfs") else ""))
    return Check("storage.locking", status, f"build lock: {why}", fix, m.as_dict())




FULL_BYTES = 1 << 20  # below this much free space the volume counts as full: the event log may not commit


def _full(ctx: Context, u) -> Check | None:
    if u.free >= FULL_BYTES:
        return None
    return Check("storage.space", WARN if ctx.for_run else FAIL,
                 f"the volume is full: {human_bytes(u.free)} free of {human_bytes(u.total)}; the event log cannot "
                 "commit, so run/resume/verify/gc cannot record anything",
                 f"free space on the volume of {ctx.lay.root} (`hsbuild gc` removes orphaned bytes; see "
                 "docs/runbook.md), then `hsbuild resume`", {"free_bytes": u.free, "total_bytes": u.total,
                                                            "full": True})


def check_space(ctx: Context) -> Check:
    full = _full(ctx, disk_usage(ctx.lay.root))
    if full is not None:
        return full
    if ctx.query is None:
        u = disk_usage(ctx.lay.root)
        return Check("storage.space", WARN, f"{human_bytes(u.free)} free ({u.usage:.1%} used); projected need "
                     f"unknown (build state unreadable: {ctx.query_error})", data={"free_bytes": u.free})
    meta = meta_of(ctx.query)
    cols, rows = ctx.query("SELECT * FROM progress")
    # the same projection as `status` (space/capacity.py): retired samples are not counted
    p = capacity_from(ctx.lay, dataclasses.replace(ctx.cfg, staging=None), dict(zip(cols, rows[0], strict=True)),
                      meta)
    wm = ctx.cfg.watermarks
    usage = 1 - p["free_bytes"] / p["total_bytes"] if p["total_bytes"] else 1.0
    data = {**p, "usage": round(usage, 4), "low": wm.low, "high": wm.high, "flood": wm.flood, "min_free": wm.min_free}
    summary = (f"{human_bytes(p['free_bytes'])} free of {human_bytes(p['total_bytes'])} ({usage:.1%} used); "
               f"projected {human_bytes(p['projected_bytes'])} more at {p['bytes_per_token']} B/token, {p['basis']}")
    if not p["fits"]:
        fix = ("free space or move the build; `hsbuild run --allow-overcommit` starts anyway and pauses writers at "
               "the watermark")
        # In a run, the watermark preflight right after decides (exit 3, or --allow-overcommit): not blocking here.
        status = WARN if ctx.for_run else FAIL
        return Check("storage.space", status, summary + f": does NOT fit below the high watermark ({pct(wm.high)})",
                     fix, data)
    if usage >= wm.low or (wm.min_free and p["free_bytes"] < wm.min_free):
        return Check("storage.space", WARN, summary + f"; fits, but usage is past the low watermark ({pct(wm.low)})",
                     "free space before the build grows: writers pause at the high watermark", data)
    return Check("storage.space", OK, summary + f"; fits below the high watermark ({pct(wm.high)})", data=data)


def check_staging(ctx: Context) -> Check | None:
    if not ctx.cfg.staging:
        return None
    path = Path(ctx.cfg.staging)
    if not path.is_dir():
        return Check("storage.staging", FAIL, f"staging directory {path} does not exist",
                     f"create it (mkdir -p {path}) or remove `staging` from hsbuild.toml", {"path": str(path)})
    u = disk_usage(path)
    found = mount_of(path)
    m = found.as_dict() if found else {"mount_point": None, "fstype": None, "device": None}
    data = {"path": str(path), "free_bytes": u.free, "total_bytes": u.total, "usage": round(u.usage, 4), **m}
    summary = f"staging {path} ({m['fstype'] or '?'}): {human_bytes(u.free)} free ({u.usage:.1%} used)"
    wm = ctx.cfg.watermarks
    if u.usage >= wm.high or (wm.min_free and u.free < wm.min_free):
        return Check("storage.staging", WARN, summary + f": past the high watermark ({pct(wm.high)}), writers will "
                     "pause at once", f"free space in {path}", data)
    return Check("storage.staging", OK, summary, data=data)


def check_writable(ctx: Context) -> Check:
    """Can an owner (run, resume, verify, gc) write the build? Read from the filesystem's flags and the
    directory's permissions, without writing: a read-only mount (an inspection after an incident) or no write
    permission makes `run` refuse (it cannot take the build lock)."""
    root = ctx.lay.root
    st = os.statvfs(root)
    if st.f_flag & os.ST_RDONLY:
        return Check("storage.writable", FAIL, f"{root} is on a read-only mount: status, sql, doctor and export read "
                     "it, but run, resume, verify and gc cannot write it", "remount the volume read-write (once it is "
                     "safe: after an incident, check it first)",
                     {"read_only_mount": True, "writable": False, "overridable": False})
    if not os.access(root, os.W_OK | os.X_OK):
        return Check("storage.writable", FAIL, f"{root} is not writable by this user: run, resume, verify and gc "
                     "cannot own it", f"fix the permissions of {root}, or run as its owner",
                     {"read_only_mount": False, "writable": False, "overridable": False})
    return Check("storage.writable", OK, f"{root} is writable (checked from its mount flags and permissions, "
                 "nothing written)", data={"read_only_mount": False, "writable": True})


STALL_CAUSES = ("the volume does not answer: writes to it (and maybe reads) do not return, while free-space figures "
                "may look fine. Likely causes: a Ceph pool, thin-provisioned volume or cloud disk that is out of space "
                "behind the filesystem (it never answers ENOSPC), an NFS or SMB server that is gone or overloaded, a "
                "failing disk. What to do: check the pool or volume under it (`ceph df`, `lvs`, the cloud console), "
                "the NFS server, `dmesg` for hung tasks; a run loses nothing and goes on by itself once writes "
                "return (a process waiting on the volume cannot be killed until then)")
STALL_FIX = ("free or grow the pool/volume under the build (or bring its server back); nothing to do in hsbuild")


def stalled(stall: dict) -> Check:
    """`storage.stall` FAIL for a stall: what, how long, where (the owner's watch, or doctor's own probe)."""
    how = "" if not stall.get("probe") else f" (doctor's own probe, which waits at most HSBUILD_STALL_S: {stall_limit():g} s)"
    return Check("storage.stall", FAIL, f"STALLED: {stall['what']} pending {stall['pending_s']:.0f} s on "
                 f"{stall['path']} ({stall['filesystem']}){how}: {STALL_CAUSES}", STALL_FIX, {"stalled": stall})


def check_stall(ctx: Context, live_status: dict | None, probed: ProbeResult | None = None) -> Check:
    """The build's volume stalled: the live owner says so, or doctor's own probe (a read, or the write probe when
    asked) did not return within HSBUILD_STALL_S, or the last stall an owner logged never ended (it was killed
    during one). Never a failure of a sample: an owner waits it out."""
    stall = (live_status or {}).get("stalled") or (probed.stall() if probed is not None else None)
    if stall:
        return stalled(stall)
    if ctx.query is not None and live_status is None:
        try:
            _, rows = ctx.query("SELECT kind, detail FROM events WHERE kind IN ('stalled', 'unstalled') "
                                "ORDER BY seq DESC LIMIT 1")
        except HsbuildError:
            rows = []
        if rows and rows[0][0] == "stalled":
            d = json.loads(rows[0][1] or "{}")
            return Check("storage.stall", WARN, f"the last owner logged a stall ({d.get('what')} on "
                         f"{d.get('path')}, {d.get('filesystem')}) that it never saw end: it ended during one. "
                         + STALL_CAUSES, f"make sure writes to {ctx.lay.root} return, then `hsbuild resume "
                         f"{ctx.lay.root}`", {"last_stall": d})
    wrote = probed is not None and probed.result("write") is not None
    if live_status:
        how = " (the owner says so)"
    elif wrote:
        how = ": reads and the write probe returned"
    else:
        how = ": reads of the build returned (writes not probed: --probe)"
    return Check("storage.stall", OK, "no stalled writes" + how if live_status or wrote else "no stall" + how)


def check_probe(ctx: Context, probed: ProbeResult | None) -> Check:
    """The write probe's figures: 4 MB written with an fsync per MB in the build directory (by a child, within
    HSBUILD_STALL_S; the file removed), or why it was not made."""
    if probed is None:
        return Check("storage.probe", OK, f"not made: doctor writes nothing to the build unless asked (--probe "
                     f"writes and fsyncs {human_bytes(WRITE_BYTES)} in the build directory, a file removed after)",
                     data={"skipped": True, "asked": False})
    if probed.stuck is not None:
        stall = probed.stall() or {}
        return Check("storage.probe", FAIL, f"the write probe did not return within {probed.waited_s:.0f} s "
                     f"(storage.stall)", STALL_FIX, {"stalled": stall})
    r = probed.result("write")
    if r is None:  # its process ended without a word (it could not start)
        return Check("storage.probe", WARN, "the write probe's process ended without reporting: not made",
                     "run `hsbuild doctor --probe` again; if it persists, report it", {"skipped": True})
    if r.get("skipped"):
        return Check("storage.probe", WARN, f"write probe skipped: only {human_bytes(r.get('free_bytes', 0))} free",
                     "free space on the build's volume", {"skipped": True})
    if not r.get("ok"):
        return Check("storage.probe", FAIL, f"cannot write to {ctx.lay.root}: {r.get('error')}",
                     "check permissions, a read-only remount, or a full/failed volume (dmesg)", {"error": r.get("error")})
    summary = (f"wrote {human_bytes(r['bytes'])} at {human_bytes(r['throughput_bps'] or 0)}/s, fsync "
               f"{r['fsync_median_s'] * 1000:.1f} ms median ({r['fsync_max_s'] * 1000:.1f} ms max)")
    data = {k: v for k, v in r.items() if k != "ok"}
    if r["fsync_median_s"] > SLOW_FSYNC_S or (r["throughput_bps"] or 0) < SLOW_WRITE_BPS:
        return Check("storage.probe", WARN, summary + ": slow storage",
                     "expect a slow run: every log commit and sealed chunk is fsynced; check the volume's health",
                     data)
    return Check("storage.probe", OK, summary, data=data)
