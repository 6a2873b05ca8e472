"""The inference server behind an engine backend, as the run sees it: wait until it is healthy, check it
serves this build's model and layers (the engine's identity check), launch and stop it (`--launch`), and bring it
back when it dies mid-run. What is the engine's own (its command, its identity check) the engine's hooks give
(builder/extract/backends/serving.py, found through the registry); the rest is the same for every engine.

Connect mode (default): hsbuild waits for a server someone else runs. Launch mode: hsbuild starts the exact
`serve-command` as its child (its output in BUILD/logs/server.log), in a process group of its own, which dies with
it (PR_SET_PDEATHSIG), so a run killed with -9 leaves no server squatting the GPUs, and restarts it when it dies.
Before a restart and at the run's end the whole group is killed: an engine's processes (its engine cores, its
workers) outlive an API server killed with -9 (they are reparented, holding the GPUs), and would otherwise
stay as rogue processes.

Which server: the engine's identity check (`ServerEngine.identity`) reads the server's own configuration besides
probing it; the workers run the same check each time the server comes back. Each build stages into its own
subfolder of the staging folder (`staging_name`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from builder.config import BuildConfig
from builder.errors import EXIT_PREFLIGHT, EXIT_WONT_FIT, HsbuildError, Interrupted, UsageError
from builder.extract.backends import registry as backends
from builder.extract.backends.http_client import EngineUnavailable, ServerRefused
from builder.extract.backends.serving import (
    IdentityRequest,
    NeverFits,
    ServerEngine,
    ServerIdentity,
    ServerPlan,
)
from builder.extract.backends.staging import clear_staging, remove_build_folder, staging_name, staging_usage
from builder.layout import BuildLayout
from builder.run.cgroup import PREFIX, ServerCgroup, reap_stale
from builder.run.prctl import die_with_parent

HEALTH_TIMEOUT = 1800.0  # a large checkpoint can take many minutes to load (the incident's: 680 s)


class EngineError(HsbuildError, ConnectionError):
    """The server never became healthy, or serves something other than this build needs."""

    exit_code = EXIT_PREFLIGHT


class EngineRefused(EngineError):
    """The server is not the build's (another model, other layers, another staging folder, unreadable without
    --trust-server): the run is refused (`engine_refused` event)."""


class StagingTooSmall(EngineError):
    """The staging volume cannot hold the probe's file even when empty: no sample could be staged there (exit 3;
    a node's on Ray is reported as its server's error)."""

    exit_code = EXIT_WONT_FIT


@dataclass
class EngineOptions:
    launch: bool = False
    health_timeout: float | None = None  # None: $HSBUILD_SERVER_TIMEOUT, else HEALTH_TIMEOUT
    trust_server: bool = False  # a server whose configuration cannot be read is judged by its answers alone


def server_hooks(cfg: BuildConfig) -> ServerEngine:
    """The server hooks of the build's engine (builder/extract/backends/serving.py), found through the registry."""
    spec = backends.of_config(cfg)
    if spec.server is None:
        raise UsageError(f"backend = {cfg.backend!r}: {spec.summary}; it runs no inference server")
    return spec.server


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    die_with_parent(signal.SIGTERM)
    os.setpgrp()  # its own process group: stopped as a whole, untouched by a Ctrl-C meant for hsbuild


class Engine:
    def __init__(self, lay: BuildLayout, cfg: BuildConfig, meta: dict, opts: EngineOptions, echo,
                 plan: ServerPlan | None = None, log_name: str = "server.log"):
        """`plan`: the server this engine is (default: the build's, as its engine plans it from hsbuild.toml);
        `log_name`: the launched server's output, in BUILD/logs/ (one per node when each node runs its own:
        builder/run/ray_engines.py)."""
        self.lay, self.cfg, self.meta, self.opts, self.echo = lay, cfg, meta, opts, echo
        self.hooks = server_hooks(cfg)
        self.plan: ServerPlan = plan or self.hooks.plan(cfg, meta)
        self.staging_dir = Path(self.plan.staging) / staging_name(meta)  # the build's own: cleared by its runs
        self.server_check: ServerIdentity | None = None  # once checked: what the workers check again
        self.log_path = lay.root / "logs" / log_name
        self.proc: subprocess.Popen | None = None
        self.cgroup: ServerCgroup | None = None  # the launched server's own cgroup, where one could be made
        self.launched_at = 0.0
        self.model_name: str | None = None
        self.restarts = 0
        self._health_stop: threading.Event | None = None  # the health watch's (`watch`): set when it is to end
        self._last_ok = 0.0  # when /health last answered (while watched)
        t = opts.health_timeout if opts.health_timeout is not None else float(
            os.environ.get("HSBUILD_SERVER_TIMEOUT", HEALTH_TIMEOUT))
        self.health_timeout = t

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, should_stop=lambda: False) -> None:
        """Launch (launch mode) and wait until healthy; then clear what crashed runs of this build left in its
        staging subfolder (other builds' subfolders are theirs)."""
        staging = Path(self.plan.staging)
        if not staging.is_dir():
            raise UsageError(f"staging {staging}: not an existing directory; create it (mkdir -p {staging}) or "
                             "fix `staging` in hsbuild.toml")
        try:
            self.staging_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise UsageError(f"staging {staging}: cannot create the build's subfolder {self.staging_dir.name} "
                             f"({e.strerror}); make the folder writable") from None
        if self.opts.launch and not self.healthy():
            self.launch()
        self.wait_healthy(should_stop)
        removed = clear_staging(self.staging_dir)
        if removed:
            self.echo(f"removed {removed} staging file(s) left by an earlier run (never trusted: re-extracted)")

    def launch(self) -> None:
        cmd = self.plan.argv()
        self.log_path.parent.mkdir(exist_ok=True)
        out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        env = dict(os.environ)
        for k, v in self.plan.env().items():  # a loopback server's internal sockets: loopback too
            env.setdefault(k, v)
        self.kill_group()  # (what is left of an earlier launch: never two servers' engines at once)
        stale = reap_stale()  # servers launched by hsbuild runs that were killed (-9) and could not stop them
        if stale:
            self.echo(f"killed {stale} process(es) left by a server that an earlier, killed hsbuild run launched")
        # its own cgroup where the machine allows: a process that leaves the group (setsid) stays contained
        self.cgroup = ServerCgroup.create(f"{PREFIX}{os.getpid()}-{self.restarts}")
        cg = self.cgroup

        def setup() -> None:  # pragma: no cover - in the child, between fork and exec
            _die_with_parent()
            if cg is not None:
                cg.enter()

        self.echo(f"launching the server ({len(cmd)} args; log: {self.log_path}; own process group"
                  + (f", cgroup {cg.path}" if cg else "") + f"): {' '.join(cmd[:6])} ...")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=setup, env=env)
        self.launched_at = time.monotonic()
        out.close()

    def wait_healthy(self, should_stop=lambda: False) -> None:
        t0 = time.monotonic()
        last = 0.0
        while not self.healthy():
            waited = time.monotonic() - t0
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"the launched server exited with code {self.proc.returncode} before it was "
                                  f"healthy; see {self.log_path}")
            if waited > self.health_timeout:
                raise EngineError(f"{self.plan.server}: not healthy after {waited:.0f} s; start it with the command "
                                  f"`hsbuild serve-command {self.lay.root}` prints (or pass --launch), or raise "
                                  "HSBUILD_SERVER_TIMEOUT")
            if should_stop():
                raise Interrupted(f"stopped while waiting for {self.plan.server} to become healthy")
            if waited - last >= 10 or last == 0.0:
                last = waited or 0.001
                self.echo(f"waiting for {self.plan.server}/health ({waited:.0f} s; "
                          f"{'launched by hsbuild' if self.proc else 'connect mode: start it yourself'}) ...")
            time.sleep(0.5)

    def stop(self) -> None:
        """At the run's end: what killed runs' requests finished writing after this run began is removed (nothing
        trusts it), and the build's subfolder with it once empty; then the launched server is stopped."""
        self.unwatch()
        try:
            remove_build_folder(self.staging_dir)
        except OSError:
            pass
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()

    def group_members(self) -> list[int]:
        """The processes still in the launched server's process group (its engine processes outlive an API
        server killed with -9: reparented, not ended)."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        out = self.cgroup.pids() if self.cgroup is not None else []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_bytes()
                    if int(stat[stat.rfind(b")") + 2:].split()[2]) == pgid and int(d.name) not in out:
                        out.append(int(d.name))
                except (OSError, ValueError, IndexError):
                    continue
        return out

    def kill_group(self, timeout: float = 30.0) -> None:
        """Kill every process of the launched server's group (SIGKILL) and wait until none is left: before a
        restart and at the run's end, so no engine process of an old server holds the GPUs the next needs."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.cgroup is not None and self.cgroup.kill(timeout):  # (also what left the group with setsid)
            self.cgroup = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [p for p in self.group_members() if _state(p) not in ("Z", None)]
            if not left:
                return
            time.sleep(0.1)

    def restart_if_dead(self) -> bool:
        """Launch mode: start the server again if it died, or if a restarted one is still not healthy after the
        health timeout (hung while loading). Returns whether it did."""
        if (self.opts.launch and self.proc is not None and self.proc.poll() is None
                and time.monotonic() - self.launched_at > self.health_timeout):
            self.echo(f"the restarted server (pid {self.proc.pid}) is not healthy after {self.health_timeout:g} s")
            self.kill_hung()
        if self.opts.launch and self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            left = self.group_members()
            self.echo(f"the server exited (code {self.proc.returncode}); restarting it (restart {self.restarts})"
                      + (f" after killing the {len(left)} process(es) of its group still running" if left else ""))
            self.launch()
            return True
        return False

    # -- the health watch: a thread, so a slow /health never stalls the run loop ------------------------------
    def watch(self, every: float = 5.0, timeout: float = 10.0) -> None:
        self._last_ok = time.monotonic()
        if self._watching():
            return
        stop = self._health_stop = threading.Event()

        def loop() -> None:  # (ends as soon as `unwatch` is called: a library caller's process goes on)
            while not stop.is_set():
                if self.hooks.healthy(self.plan.server, timeout=timeout):
                    self._last_ok = time.monotonic()
                stop.wait(every)

        threading.Thread(target=loop, name="hsbuild-health", daemon=True).start()

    def unresponsive_for(self) -> float:
        """Seconds since /health last answered (0 when the watch is off)."""
        return time.monotonic() - self._last_ok if self._watching() else 0.0

    def _watching(self) -> bool:
        return self._health_stop is not None and not self._health_stop.is_set()

    def unwatch(self) -> None:
        if self._health_stop is not None:
            self._health_stop.set()

    def kill_hung(self) -> None:
        """Launch mode: a server that is alive but does not answer /health is killed (then restarted)."""
        if self.opts.launch and self.proc is not None and self.proc.poll() is None:
            self.echo(f"the server (pid {self.proc.pid}) stopped answering /health; killing it to restart it")
            self.kill_group()

    def healthy(self) -> bool:
        return self.hooks.healthy(self.plan.server)

    @property
    def server(self) -> str:
        """The server, as messages name it."""
        return self.plan.server

    def staging_usage(self) -> tuple[int, int]:
        """(files, bytes) in the build's staging subfolder now."""
        return staging_usage(self.staging_dir)

    # -- what it serves ----------------------------------------------------------------------------------------
    def check(self, recorded: dict | None) -> dict:
        """The server is the build's (the engine's identity check: its command line, /v1/models, a probe compared
        with the build's first probe when there is one). Keeps what the workers check again when it comes back
        (with this run's probe as the reference on a build's first run). EngineError (exit 4) when it is not."""
        identity = self.hooks.identity(IdentityRequest(
            plan=self.plan, cfg=self.cfg, meta=self.meta, staging_dir=str(self.staging_dir),
            build_root=str(self.lay.root), recorded=recorded, trust=self.opts.trust_server))
        try:
            found = identity.check()
        except ServerRefused as e:
            raise EngineRefused(str(e)) from None
        except NeverFits as e:  # (the probe's file is the smallest a run stages)
            raise StagingTooSmall(str(e)) from None
        except EngineUnavailable as e:
            raise EngineError(f"{self.plan.server}: the probe request failed ({e})") from None
        self.model_name = found["model_id"]
        self.server_check = identity.confirmed(found)
        return found


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, D, Z, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat[stat.rfind(b")") + 2:].split()[0].decode()
    except (OSError, IndexError):
        return None
