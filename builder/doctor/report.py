"""`hsbuild doctor` and the preflight of `run`/`resume`: typed findings, recorded as a `doctor` event.

The library never prints: `run_doctor` and `preflight_for_run` return a `DoctorReport` (a list of `Check`s,
each ok/warn/fail with a fix), `render_lines` turns one into text for people, and `preflight_for_run` raises
`PreflightError` on blocking ('fail') problems unless forced. The report goes into the event log as
`Event('doctor', reason=<worst status>, detail=<the report as JSON>)` so SQL can show it later.

Standalone doctor works whether or not a run is going, and writes nothing to the build: it first reads the build's
storage from a child process with a deadline (builder/space/probe.py: a volume that does not answer is named,
`storage.stall`, instead of holding doctor in the kernel); while a live process holds the build lock it never
opens the DuckDB file (the owner holds it) and asks the owner over its socket (`query.run_query`); otherwise it
opens the log read-only. Only when asked does it write: `probe` (a 4 MB write probe, in the child) and `record`
(it takes the lock for a moment and records its report as a `doctor` event). A run's preflight records its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from builder.config import BuildConfig, load_config
from builder.doctor import checks as dc
from builder.doctor import engine as de
from builder.doctor import storage as ds
from builder.doctor.checks import FAIL, OK, WARN, Check, Context, plural
from builder.errors import BuildLockedError, DiskFullError, HsbuildError, PreflightError
from builder.extract.spec import check_device_spec
from builder.layout import BuildLayout
from builder.log.events import Event, EventLog, open_log
from builder.log.lock import BuildLock, LockState, inspect_lock
from builder.log.query import jsonable, run_query, status_snapshot
from builder.log.stall import stall_limit
from builder.space import probe as space_probe

__all__ = ["Check", "DoctorReport", "run_doctor", "preflight_for_run", "render_lines", "OK", "WARN", "FAIL"]

_RANK = {OK: 0, WARN: 1, FAIL: 2}


@dataclass
class DoctorReport:
    build: str
    context: str  # 'doctor' (standalone) or 'run' (preflight)
    device: str
    checks: list[Check] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    forced: bool = False
    recorded: bool = False  # a `doctor` event holds this report
    run_id: str | None = None

    @property
    def status(self) -> str:
        return max((c.status for c in self.checks), key=_RANK.__getitem__, default=OK)

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def gpu_build(self) -> bool:
        g = self.get("gpu")
        return bool(g and g.data.get("gpu_build"))

    def get(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def as_dict(self) -> dict:
        return {"build": self.build, "context": self.context, "device": self.device,
                "mode": "gpu" if self.gpu_build else "cpu", "status": self.status, "forced": self.forced,
                "created_at": self.created_at, "run_id": self.run_id, "recorded": self.recorded,
                "problems": len(self.problems), "warnings": len(self.warnings),
                "checks": [c.as_dict() for c in self.checks]}


# ---------------------------------------------------------------------------------------------------
# Running the checks
# ---------------------------------------------------------------------------------------------------


# Checks whose worst finding is a WARN: they inform, never block. A crash of one of them is a WARN too.
ADVISORY = frozenset({"storage.filesystem", "build.lock", "build.interrupted", "build.failed"})


def crash_line(e: BaseException) -> str:
    """'TypeError: first line of its message', for one line of a report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _guard(name: str, fn: Callable[[], Check | list[Check] | None]) -> list[Check]:
    """A check that crashes is a finding, never the end of doctor. Fails closed: a check that can block a run
    (anything but ADVISORY) and could not run is a FAIL naming it and the exception, so `run` refuses unless
    --force, as it would for the problem the check was to rule out."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001
        why = crash_line(e)
        fix = "report this to the hsbuild maintainers with this line"
        if name in ADVISORY:
            return [Check(name, WARN, f"check could not run ({why})", fix, {"crashed": why})]
        return [Check(name, FAIL, f"check crashed ({why}): cannot tell whether this blocks the build", fix
                      + "; once you made sure by hand, --force starts the run anyway", {"crashed": why})]
    if out is None:
        return []
    return out if isinstance(out, list) else [out]


def _system_checks(ctx: Context) -> list[Check]:
    """Checks that do not read the event log: environment, GPUs, filesystem (the write probe apart: `_probe_checks`)."""
    checks = _guard("env.torch", lambda: dc.check_torch(ctx))
    checks += _guard("env.model", lambda: dc.check_model(ctx))
    checks += _guard("env.source", lambda: dc.check_source(ctx))
    checks += _guard("env.engine_orphans", lambda: de.check_engine_orphans(ctx))
    checks += _guard("gpu", lambda: dc.check_gpus(ctx))
    checks += _guard("storage.filesystem", lambda: ds.check_filesystem(ctx))
    checks += _guard("storage.writable", lambda: ds.check_writable(ctx))
    checks += _guard("storage.locking", lambda: ds.check_locking(ctx))
    checks += _guard("storage.staging", lambda: ds.check_staging(ctx))
    if not ctx.for_run:  # a run probes the server itself, after waiting for it
        checks += _guard("env.server", lambda: de.check_server(ctx))
    _guard("build.fingerprint", lambda: dc.prepare_model_fingerprint(ctx) and None)
    return checks


def _state_checks(ctx: Context, lock_state: LockState | None, previous_owner: dict | None) -> list[Check]:
    """Checks of the build state (through ctx.query) and of the lock."""
    checks = _guard("build.lock", lambda: dc.check_lock(ctx, lock_state, previous_owner))
    checks += _guard("storage.space", lambda: ds.check_space(ctx))
    if ctx.query is None:
        return checks + [Check("build.state", WARN, f"the event log could not be read: {ctx.query_error}",
                               "try again; if it persists, see `hsbuild status`")]
    last_owner = previous_owner if ctx.for_run else (lock_state.info if lock_state and not lock_state.held else None)
    checks += _guard("build.interrupted", lambda: dc.check_interrupted(ctx, last_owner))
    checks += _guard("build.failed", lambda: dc.check_failed(ctx))
    checks += _guard("build.fingerprint", lambda: dc.check_fingerprints(ctx))
    return checks


_ORDER = ("env.", "gpu", "storage.", "build.")


def _ordered(checks: list[Check]) -> list[Check]:
    def key(c: Check) -> int:
        return next((i for i, p in enumerate(_ORDER) if c.name.startswith(p)), len(_ORDER))

    return sorted(checks, key=key)  # stable: keeps each group's own order


def _event(report: DoctorReport) -> Event:
    return Event("doctor", run_id=report.run_id, reason=report.status,
                 detail=json.dumps(jsonable(report.as_dict()), sort_keys=True, default=str))


@contextlib.contextmanager
def _build_reader(lay: BuildLayout, record: bool) -> Iterator[tuple[str, EventLog | None, LockState]]:
    """('live', None, state) while a run owns the build; ('locked', log, state) with doctor holding the lock
    (record=True); ('read_only', log, state) otherwise."""
    state = inspect_lock(lay)
    if not state.held and record:
        try:
            lock = BuildLock(lay, "doctor").acquire()
        except BuildLockedError:
            lock = None  # a run started just now (ask it), or a record from another host (read only)
        except OSError:
            lock = None  # cannot write here (someone else's build, read-only mount, full disk): read only
        if lock is not None:
            try:
                try:
                    log = open_log(lay.events, wait=10.0)
                except DiskFullError:
                    log = None  # cannot even open it for writing: read it, record nothing
                if log is not None:
                    try:
                        yield "locked", log, state
                    finally:
                        log.close()
                    return
            finally:
                lock.release(keep_previous=True)
        state = inspect_lock(lay)
    if state.held:
        yield "live", None, state
        return
    log = open_log(lay.events, read_only=True, wait=5.0)
    try:
        yield "read_only", log, state
    finally:
        log.close()


def run_doctor(lay: BuildLayout, *, device: str | None = None, record: bool = False, probe: bool = False,
               gpu_mem_threshold: int = dc.GPU_MEM_THRESHOLD,
               cgroup_reader: Callable[[int], str | None] | None = None) -> DoctorReport:
    """Standalone doctor. Writes nothing to the build unless asked: `probe` makes the 4 MB write probe, `record`
    records the report as a `doctor` event (when no run is going; it takes the build lock for a moment). The
    build's storage is read first by a child within HSBUILD_STALL_S: a volume that does not answer gives a
    report naming the stall (storage.stall FAIL) without reading anything else of it.

    A write probe that does not return leaves its create pending in the build directory, which holds every later
    lookup there: it is made last (`probe`), or, when recording, first (recording writes: a volume whose writes
    hang records nothing), and then nothing more of the build is read."""
    limit = stall_limit()
    seen = space_probe.probe(space_probe.reader_steps(lay), limit, lay.root)
    if seen.stuck is not None:
        return _stalled_report(lay, device, seen)
    lay.require()
    cfg = load_config(lay)
    dev = device or cfg.device
    check_device_spec(dev)  # a bad --device is a usage error, not a finding to record
    from builder.extract.backends.registry import of_config  # noqa: PLC0415

    # an engine's GPUs are the server's; hsbuild computes on none (env.server)
    dev = of_config(cfg, lay.config).device or dev
    report = DoctorReport(str(lay.root), "doctor", dev, run_id=uuid.uuid4().hex)
    first = inspect_lock(lay)
    own = {os.getpid()}
    if first.held and first.info and first.info.get("pid"):
        own.add(int(first.info["pid"]))
    # live: an owner holds the build (a run may be using its server: env.server sends no probe then)
    ctx = Context(lay, cfg, dev, own, for_run=False, live=first.held, gpu_mem_threshold=gpu_mem_threshold,
                  cgroup_reader=cgroup_reader)
    live_status = None
    if first.held:  # the owner's own view first: during a stall doctor must not write (its probe would hang)
        try:
            live_status = status_snapshot(lay)
        except HsbuildError:
            live_status = None
    may_write = not (live_status or {}).get("stalled")
    written = None
    if record and may_write and not first.held:
        written = space_probe.probe([space_probe.write_step(lay.root)], limit, lay.root)
        if written.stuck is not None:
            return _stalled_report(lay, device, written)
    checks = _system_checks(ctx)
    with _build_reader(lay, record) as (how, log, state):
        ctx.live = how == "live"
        if how == "live":
            if state.info and state.info.get("pid"):
                ctx.own_pids.add(int(state.info["pid"]))
            ctx.query = _live_query(lay)
            try:
                ctx.query("SELECT count(*) FROM meta")
            except HsbuildError as e:  # the owner does not answer (still starting, or stuck): skip state checks
                ctx.query, ctx.query_error = None, str(e)
        else:
            assert log is not None
            ctx.query = log.query
        # `state`: the lock as it was before doctor took it (doctor's own lock would hide a stale one)
        checks += _state_checks(ctx, state, None)
        if probe and may_write and written is None:  # last: nothing of the build is read after it
            written = space_probe.probe([space_probe.write_step(lay.root)], limit, lay.root)
        checks += _guard("storage.probe", lambda: ds.check_probe(ctx, written))
        checks += _guard("storage.stall", lambda: ds.check_stall(ctx, live_status if how == "live" else None,
                                                                 written if written is not None else seen))
        report.checks = _ordered(checks)
        if how == "locked" and log is not None:
            try:
                log.append([_event(report)])
                report.recorded = True
            except DiskFullError as e:  # a finding, not a crash
                report.checks = _ordered(report.checks + [Check(
                    "storage.record", FAIL, f"cannot record this report: {e}",
                    f"free space on the volume of {lay.root}, then `hsbuild resume`", {"recorded": False})])
    return report


def _stalled_report(lay: BuildLayout, device: str | None, seen: space_probe.ProbeResult) -> DoctorReport:
    """The report for a build whose volume does not answer a read: the stall, and nothing else read of it."""
    stall = seen.stall() or {}
    report = DoctorReport(str(lay.root), "doctor", device or "?")
    report.checks = [ds.stalled(stall), Check(
        "build.state", WARN, "not read: doctor reads nothing more of a volume that does not answer (the build's "
        "configuration, lock and log included)", f"once {lay.root} answers again, run `hsbuild doctor` again",
        {"read": False})]
    return report


def _live_query(lay: BuildLayout) -> dc.Query:
    def q(sql: str) -> tuple[list[str], list[list]]:
        return run_query(lay, sql)

    return q


def preflight_for_run(lay: BuildLayout, cfg: BuildConfig, log: EventLog, force: bool, own_pids: set[int], *,
                      device: str | None = None, run_id: str | None = None, previous_owner: dict | None = None,
                      probe: bool = True, gpu_mem_threshold: int = dc.GPU_MEM_THRESHOLD,
                      cgroup_reader: Callable[[int], str | None] | None = None) -> DoctorReport:
    """The doctor checks at the start of `run`/`resume`, inside the run's lock, on its open writable log.

    Records the report as a `doctor` event, then raises PreflightError (exit code 4) listing the blocking
    problems and their fixes unless `force`. `device`: the device the run uses (its --device, else config);
    `previous_owner`: `BuildLock.previous` (a dead owner the run took the lock over from).
    """
    dev = device or cfg.device
    report = DoctorReport(str(lay.root), "run", dev, run_id=run_id)
    ctx = Context(lay, cfg, dev, set(own_pids) | {os.getpid()}, for_run=True, query=log.query,
                  gpu_mem_threshold=gpu_mem_threshold, cgroup_reader=cgroup_reader)
    checks = _system_checks(ctx) + _state_checks(ctx, None, previous_owner)
    if probe:  # in a child within HSBUILD_STALL_S: a volume whose writes hang is a FAIL, not a hang here
        written = space_probe.probe([space_probe.write_step(lay.root)], stall_limit(), lay.root)
        checks += _guard("storage.probe", lambda: ds.check_probe(ctx, written))
        if written.stuck is not None:
            checks += [ds.check_stall(ctx, None, written)]
    report.checks = _ordered(checks)
    report.forced = bool(force and report.problems and not unforceable(report))
    try:
        log.append([_event(report)])
    except DiskFullError as e:
        raise DiskFullError(f"{lay.root}: the volume is full, so the event log cannot commit and the run cannot "
                            "start; free space (`hsbuild gc` removes orphaned bytes), then `hsbuild resume`") from e
    report.recorded = True
    if report.problems and (not force or unforceable(report)):
        hard = unforceable(report)  # one line: what no flag can fix, and the way out
        err = PreflightError(f"{hard[0].name}: {hard[0].summary}; fix: {hard[0].fix}" if hard
                             else preflight_message(report))
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


# ---------------------------------------------------------------------------------------------------
# Text for people
# ---------------------------------------------------------------------------------------------------

LABEL = {OK: "OK", WARN: "WARN", FAIL: "FAIL"}


def render_lines(report: DoctorReport, only_problems: bool = False) -> list[str]:
    """One line per check (OK / WARN / FAIL), the detail lines under it, and the fix; a fix already shown
    is referred to instead of repeated."""
    width = max((len(c.name) for c in report.checks), default=8)
    mode = "GPU" if report.gpu_build else "CPU"
    lines = [f"hsbuild doctor {report.build}: device {report.device} ({mode} build)" if report.device != "?" else
             f"hsbuild doctor {report.build}: its volume does not answer"]
    shown: dict[str, str] = {}
    for c in report.checks:
        if only_problems and c.status == OK:
            continue
        lines.append(f"{LABEL[c.status]:<4}  {c.name:<{width}}  {c.summary}")
        pad = " " * (8 + width)
        lines += [pad + d for d in c.details]
        if c.fix and c.status != OK:
            if c.fix in shown:
                lines.append(f"{pad}fix: as for {shown[c.fix]}")
            else:
                shown[c.fix] = c.name
                lines.append(f"{pad}fix: {c.fix}")
    lines.append(tally(report))
    return lines


def _by_fix(checks: list[Check]) -> list[list[Check]]:
    """Checks grouped by their fix (one cause seen on several devices is one problem), in report order."""
    groups: dict[str, list[Check]] = {}
    for c in checks:
        groups.setdefault(c.fix or f"\0{c.name}", []).append(c)
    return list(groups.values())


def unforceable(report: DoctorReport) -> list[Check]:
    """Blocking problems --force does not override (a build that would hold two formats)."""
    return [c for c in report.problems if c.data.get("overridable") is False]


def _override_note(report: DoctorReport) -> str:
    hard = unforceable(report)
    if not hard:
        return "--force overrides"
    names = ", ".join(dict.fromkeys(c.name for c in hard))
    return f"--force does not override {names}" + (", only the others" if len(hard) < len(report.problems) else "")


def tally(report: DoctorReport) -> str:
    fails, warns = report.problems, report.warnings
    if fails:
        n = len(_by_fix(fails))
        also = f" ({len(fails)} checks FAIL)" if len(fails) != n else ""
        return (f"{plural(n, 'blocking problem')}{also}, {plural(len(warns), 'warning')}: `hsbuild run` refuses "
                f"to start ({_override_note(report)})")
    if warns:
        return f"no blocking problems, {plural(len(warns), 'warning')}"
    return "all checks OK"


def preflight_message(report: DoctorReport) -> str:
    groups = _by_fix(report.problems)
    lines = [f"{plural(len(groups), 'blocking preflight problem')} in {report.build}:"]
    for g in groups:
        lines.append(f"  {g[0].name}: {g[0].summary}")
        if len(g) > 1:
            lines.append(f"    (also {', '.join(c.name for c in g[1:])})")
        if g[0].fix:
            lines.append(f"    fix: {g[0].fix}")
    if unforceable(report):
        lines.append(f"see `hsbuild doctor {report.build}`; {_override_note(report)}")
    else:
        lines.append(f"see `hsbuild doctor {report.build}`; pass --force to start anyway")
    return "\n".join(lines)


def warning_lines(report: DoctorReport) -> list[str]:
    """What a run should echo when it starts despite findings (warnings, or problems overridden by --force)."""
    out = []
    for c in report.checks:
        if c.status != OK:
            forced = " (--force)" if c.status == FAIL else ""
            out.append(f"preflight {LABEL[c.status]}{forced}: {c.name}: {c.summary}"
                       + (f" [fix: {c.fix}]" if c.fix else ""))
    return out


__all__ += ["preflight_message", "warning_lines"]
