"""The inference server behind an engine backend, as the run sees it: wait until it is healthy, check it
serves this build's model and layers (one probe), launch and stop it (`--launch`), and bring it back when it
dies mid-run.

Connect mode (default): hsbuild waits for a server someone else runs. Launch mode: hsbuild starts the exact
`serve-command` as its child (its output in BUILD/logs/server.log), which dies with it (PR_SET_PDEATHSIG), so
a run killed with -9 leaves no server squatting the GPUs, and restarts it when it dies."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from builder.config import BuildConfig
from builder.errors import EXIT_PREFLIGHT, HsbuildError, UsageError
from builder.extract.backends.engine import EngineUnavailable, healthy
from builder.extract.backends.vllm import VllmSettings, clear_staging, staging_usage
from builder.extract.backends.vllm_server import (
    EngineSpec,
    probe,
    probe_problems,
    serve_command,
    signature_differs,
)
from builder.layout import BuildLayout

DEFAULT_INFLIGHT = 16
HEALTH_TIMEOUT = 1800.0  # a large checkpoint can take many minutes to load (the incident's: 680 s)


class EngineError(HsbuildError, ConnectionError):
    """The server never became healthy, or serves something other than this build needs."""

    exit_code = EXIT_PREFLIGHT


@dataclass
class EngineOptions:
    launch: bool = False
    health_timeout: float | None = None  # None: $HSBUILD_SERVER_TIMEOUT, else HEALTH_TIMEOUT


def engine_spec(cfg: BuildConfig, meta: dict) -> EngineSpec:
    extra = cfg.engine_args or []
    return EngineSpec(model=cfg.model, server=cfg.server or "", staging=str(Path(cfg.staging or "").absolute()),
                      layer_ids=list(meta.get("engine_layer_ids") or []), dtype=cfg.dtype,
                      connector=cfg.engine_connector, connector_module=cfg.engine_connector_module,
                      engine_args=tuple(extra))


def vllm_settings(cfg: BuildConfig, meta: dict, model_name: str) -> VllmSettings:
    return VllmSettings(server=cfg.server or "", model_name=model_name, staging=str(cfg.staging),
                        aux_layers=list(meta["aux_layers"]), num_layers=int(meta["num_layers"]),
                        hidden_size=int(meta["hidden_size"]), dtype=cfg.dtype, final_state=cfg.final_state,
                        inflight=cfg.inflight or DEFAULT_INFLIGHT)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()  # its own process group: stopped as a whole, untouched by a Ctrl-C meant for hsbuild


class Engine:
    def __init__(self, lay: BuildLayout, cfg: BuildConfig, meta: dict, opts: EngineOptions, echo,
                 spec: EngineSpec | None = None, log_name: str = "server.log"):
        """`spec`: the server this engine is (default: the build's, from hsbuild.toml); `log_name`: the launched
        server's output, in BUILD/logs/ (one per node when each node runs its own: builder/run/ray_engines.py)."""
        self.lay, self.cfg, self.meta, self.opts, self.echo = lay, cfg, meta, opts, echo
        self.spec = spec or engine_spec(cfg, meta)
        self.log_path = lay.root / "logs" / log_name
        self.proc: subprocess.Popen | None = None
        self.launched_at = 0.0
        self.model_name: str | None = None
        self.restarts = 0
        t = opts.health_timeout if opts.health_timeout is not None else float(
            os.environ.get("HSBUILD_SERVER_TIMEOUT", HEALTH_TIMEOUT))
        self.health_timeout = t

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, should_stop=lambda: False) -> None:
        """Launch (launch mode) and wait until healthy; then clear what crashed runs left in staging."""
        staging = Path(self.spec.staging)
        if not staging.is_dir():
            raise UsageError(f"staging {staging}: not an existing directory; create it (mkdir -p {staging}) or "
                             "fix `staging` in hsbuild.toml")
        if self.opts.launch and not healthy(self.spec.server):
            self.launch()
        self.wait_healthy(should_stop)
        removed = clear_staging(staging)
        if removed:
            self.echo(f"removed {removed} staging file(s) left by an earlier run (never trusted: re-extracted)")

    def launch(self) -> None:
        cmd = serve_command(self.spec)
        self.log_path.parent.mkdir(exist_ok=True)
        out = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        env = dict(os.environ)
        if urlparse(self.spec.server).hostname in ("127.0.0.1", "localhost"):  # its internal sockets: loopback too
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self.echo(f"launching the server ({len(cmd)} args; log: {self.log_path}): {' '.join(cmd[:6])} ...")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent, env=env)
        self.launched_at = time.monotonic()
        out.close()

    def wait_healthy(self, should_stop=lambda: False) -> None:
        t0 = time.monotonic()
        last = 0.0
        while not healthy(self.spec.server):
            waited = time.monotonic() - t0
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"the launched server exited with code {self.proc.returncode} before it was "
                                  f"healthy; see {self.log_path}")
            if waited > self.health_timeout:
                raise EngineError(f"{self.spec.server}: not healthy after {waited:.0f} s; start it with the command "
                                  f"`hsbuild serve-command {self.lay.root}` prints (or pass --launch), or raise "
                                  "HSBUILD_SERVER_TIMEOUT")
            if should_stop():
                raise EngineError(f"stopped while waiting for {self.spec.server} to become healthy")
            if waited - last >= 10 or last == 0.0:
                last = waited or 0.001
                self.echo(f"waiting for {self.spec.server}/health ({waited:.0f} s; "
                          f"{'launched by hsbuild' if self.proc else 'connect mode: start it yourself'}) ...")
            time.sleep(0.5)

    def stop(self) -> None:
        self.unwatch()
        try:  # what killed runs' requests finished writing after this run began: nothing trusts it
            clear_staging(Path(self.spec.staging))
        except OSError:
            pass
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart_if_dead(self) -> bool:
        """Launch mode: start the server again if it died, or if a restarted one is still not healthy after the
        health timeout (hung while loading). Returns whether it did."""
        if (self.opts.launch and self.proc is not None and self.proc.poll() is None
                and time.monotonic() - self.launched_at > self.health_timeout):
            self.echo(f"the restarted server (pid {self.proc.pid}) is not healthy after {self.health_timeout:g} s")
            self.kill_hung()
        if self.opts.launch and self.proc is not None and self.proc.poll() is not None:
            self.restarts += 1
            self.echo(f"the server exited (code {self.proc.returncode}); restarting it (restart {self.restarts})")
            self.launch()
            return True
        return False

    # -- the health watch: a thread, so a slow /health never stalls the run loop ------------------------------
    def watch(self, every: float = 5.0, timeout: float = 10.0) -> None:
        self._last_ok = time.monotonic()
        if getattr(self, "_watching", False):
            return
        self._watching = True

        def loop() -> None:
            while self._watching:
                if healthy(self.spec.server, timeout=timeout):
                    self._last_ok = time.monotonic()
                time.sleep(every)

        threading.Thread(target=loop, name="hsbuild-health", daemon=True).start()

    def unresponsive_for(self) -> float:
        """Seconds since /health last answered (0 when the watch is off)."""
        return time.monotonic() - self._last_ok if getattr(self, "_watching", False) else 0.0

    def unwatch(self) -> None:
        self._watching = False

    def kill_hung(self) -> None:
        """Launch mode: a server that is alive but does not answer /health is killed (then restarted)."""
        if self.opts.launch and self.proc is not None and self.proc.poll() is None:
            self.echo(f"the server (pid {self.proc.pid}) stopped answering /health; killing it to restart it")
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def healthy(self) -> bool:
        return healthy(self.spec.server)

    @property
    def server(self) -> str:
        """The server, as messages name it."""
        return self.spec.server

    def staging_usage(self) -> tuple[int, int]:
        """(files, bytes) in its staging folder now."""
        return staging_usage(Path(self.spec.staging))

    # -- what it serves ----------------------------------------------------------------------------------------
    def check(self, recorded: dict | None) -> dict:
        """Probe: the server returns this build's layer count, hidden size and dtype, and (after the first run)
        the same states for the fixed probe prompt as the server the build began with."""
        try:
            p = probe(self.spec.server, int(self.meta["vocab_size"]))
        except EngineUnavailable as e:
            raise EngineError(f"{self.spec.server}: the probe request failed ({e})") from None
        self.model_name = p.model_id
        problems = probe_problems(p, self.spec.layer_ids, int(self.meta["hidden_size"]), self.cfg.dtype)
        if not problems and recorded and recorded.get("signature"):
            rel = signature_differs(p.signature, recorded["signature"])
            if rel is not None:
                problems.append(f"returns other states for the probe prompt than when the build began (largest "
                                f"relative difference {rel:.1%}): another model or other layers")
        if problems:
            raise EngineError(f"{self.spec.server} (serving {p.root}): " + "; ".join(problems)
                              + f". Serve the build's model with `hsbuild serve-command {self.lay.root}`")
        return {"model_id": p.model_id, "root": p.root, "layers": p.layers, "hidden": p.hidden, "dtype": p.dtype,
                "signature": p.signature}

