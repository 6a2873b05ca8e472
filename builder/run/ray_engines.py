"""An engine backend across nodes (`hsbuild run BUILD --ray ... ` on a build whose backend runs a server): one
inference server per node, and one worker per server, on the same node, talking to it over loopback and
ingesting its states from a staging folder local to that node. What an actor reserves on its node and how a
worker is pointed at its node's server are the engine's (`ServerEngine.placement`, `settings_at`).

Each node's server is watched by an `EngineHost` actor pinned to that node: it wraps the very `Engine` a local
run uses (builder/run/server_lifecycle.py: wait until healthy, probe, launch and restart in launch mode, the health
watch). The driver sees them all through `RayEngines`, which answers the coordinator's engine calls for the
whole cluster: healthy when every node's server is; restarting whichever died. A node that is gone (its actor
unreachable) is dropped; its worker is lost with it and its samples go back to pending.

Launch mode (`--launch`): each node's server listens on 127.0.0.1 at a port free on that node, and stages into
`STAGING/node-<node id>` (created on that node); its output goes to BUILD/logs/server-<node id>.log. Connect
mode: each node runs its own server at the build's `server` URL (a loopback address, interpreted on that
node) with the build's `staging` folder (a path local to that node).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from builder.config import BuildConfig
from builder.errors import UsageError
from builder.extract.backends.staging import clear_staging, staging_name
from builder.run.server_lifecycle import Engine, EngineError, EngineOptions, EngineRefused, server_hooks

LOOPBACK = ("127.0.0.1", "localhost", "::1")
CALL_SECONDS = 30.0  # a call to a node's EngineHost that takes longer: the node is treated as gone
STATE_SECONDS = 1.0  # how often the nodes' servers are asked how they are


@dataclass(frozen=True)
class NodeEngine:
    """One node's server, as its worker needs it."""

    node_id: str
    host: str
    server: str
    staging: str


@dataclass(frozen=True)
class HostAnswer:
    """What an EngineHost call returns: a value, or the error it met (typed here: Ray would wrap it)."""

    value: object = None
    error: str | None = None
    usage: bool = False  # the error is the user's to fix (exit 2), not the server's
    refused: bool = False  # the error is a refusal: the server is not the build's
    lines: tuple[str, ...] = ()  # what the node's engine had to say since the last call


def check_connect_server(cfg: BuildConfig) -> None:
    """Connect mode across nodes: each worker talks to the server on its own node, so the URL must be loopback."""
    server = cfg.server
    host = urlparse(server or "").hostname
    if host not in LOOPBACK:
        raise UsageError(f"--ray with --backend {cfg.backend}: the build's server {server} is not a loopback "
                         "address; every node's worker talks to the server on its own node (e.g. http://127.0.0.1:8000, run on "
                         "each node), or pass --launch to start one per node")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineHost:
    """One node's server (decorated with ray.remote by `RayEngines`): a threaded actor, so that `halt` reaches
    it while `start` waits for the server to become healthy."""

    def __init__(self, build_root: str, cfg: BuildConfig, meta: dict, launch: bool, trust_server: bool = False) -> None:
        from builder.layout import layout  # noqa: PLC0415

        self.lay, self.cfg, self.meta, self.launch = layout(Path(build_root)), cfg, meta, launch
        self.trust_server = trust_server
        self.engine: Engine | None = None
        self.lines: list[str] = []
        self.halted = False
        self._lock = threading.Lock()

    def _answer(self, value: object = None, error: str | None = None, usage: bool = False,
                refused: bool = False) -> HostAnswer:
        with self._lock:
            lines, self.lines = tuple(self.lines), []
        return HostAnswer(value, error, usage, refused, lines)

    def _echo(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def start(self) -> HostAnswer:
        """Launch (launch mode) and wait until healthy. Value: the NodeEngine."""
        import ray  # noqa: PLC0415

        node_id = ray.get_runtime_context().get_node_id()
        plan = server_hooks(self.cfg).plan(self.cfg, self.meta)
        if self.launch:
            staging = Path(plan.staging) / f"node-{node_id[:12]}"
            try:
                staging.mkdir(exist_ok=True)
            except OSError as e:
                return self._answer(error=f"cannot create the staging folder {staging}: {e}; the build's staging "
                                    "must be an existing directory on every node", usage=True)
            plan = plan.at(f"http://127.0.0.1:{_free_port()}", str(staging))
        self.engine = Engine(self.lay, self.cfg, self.meta,
                             EngineOptions(launch=self.launch, trust_server=self.trust_server), self._echo,
                             plan=plan, log_name=f"server-{node_id[:12]}.log" if self.launch else "server.log")
        try:
            self.engine.start(lambda: self.halted)
        except UsageError as e:
            return self._answer(error=str(e), usage=True)
        except EngineError as e:
            return self._answer(error=str(e))
        return self._answer(NodeEngine(node_id, socket.gethostname(), plan.server, plan.staging))

    def halt(self) -> None:
        """Stop waiting in `start`."""
        self.halted = True

    def check(self, recorded: dict | None) -> HostAnswer:
        """Value: (what the check found, the identity check its worker runs when the server comes back)."""
        try:
            found = self.engine.check(recorded)
        except EngineError as e:
            return self._answer(error=str(e), refused=isinstance(e, EngineRefused))
        return self._answer((found, self.engine.server_check))

    def watch(self) -> HostAnswer:
        self.engine.watch()
        return self._answer()

    def state(self) -> HostAnswer:
        """(healthy, seconds /health has not answered, restarts, staging files, staging bytes)."""
        files, size = self.engine.staging_usage()
        return self._answer((self.engine.healthy(), self.engine.unresponsive_for(), self.engine.restarts, files,
                             size))

    def restart_if_dead(self) -> HostAnswer:
        return self._answer(self.engine.restart_if_dead())

    def kill_hung(self) -> HostAnswer:
        self.engine.kill_hung()
        return self._answer()

    def stop(self) -> HostAnswer:
        if self.engine is not None:
            self.engine.stop()
        return self._answer()


class RayEngines:
    """Every node's server, answering the calls the coordinator makes of its one `Engine`."""

    def __init__(self, ray, nodes: list[dict], lay, cfg: BuildConfig, meta: dict, launch: bool, echo,
                 trust_server: bool = False) -> None:
        if not launch:
            check_connect_server(cfg)
        self.hooks = server_hooks(cfg)
        self.ray, self.lay, self.cfg, self.meta, self.launch, self.echo = ray, lay, cfg, meta, launch, echo
        self.trust_server = trust_server
        self.checks: dict[str, object] = {}  # node id -> the identity check its worker runs when its server returns
        self._cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(EngineHost)
        self._nodes = nodes
        self.hosts: dict[str, object] = {}  # node id -> its EngineHost actor (the nodes still here)
        self.engines: dict[str, NodeEngine] = {}
        self.gone: dict[str, str] = {}  # node id -> why it was dropped
        self.model_name: str | None = None
        self._restarts: dict[str, int] = {}
        self._state: dict[str, tuple] = {}
        self._asked = self._acted = 0.0  # when the last poll began; the last restart or kill
        self._poller: threading.Thread | None = None
        self._hosts_lock = threading.Lock()

    # -- calls --------------------------------------------------------------------------------------------------
    def _call(self, nid: str, method: str, *args, timeout: float = CALL_SECONDS) -> HostAnswer | None:
        """One node's answer; None (and the node dropped) when its actor is unreachable."""
        actor = self.hosts.get(nid)
        if actor is None:
            return None
        try:
            ans: HostAnswer = self.ray.get(getattr(actor, method).remote(*args), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - RayActorError, GetTimeoutError, node lost: the node is gone
            self._drop(nid, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return None
        self._say(nid, ans)
        return ans

    def _say(self, nid: str, ans: HostAnswer) -> None:
        for line in ans.lines:
            self.echo(f"node {nid[:12]}: {line}")

    def _drop(self, nid: str, why: str) -> None:
        with self._hosts_lock:
            gone = self.hosts.pop(nid, None)
        if gone is not None:
            self.gone[nid] = why
            self.echo(f"node {nid[:12]}: its server's host is gone ({why}); the run goes on without it")

    def _all(self, method: str, *args) -> dict[str, HostAnswer]:
        """Every node's answer, the calls made concurrently."""
        refs = {nid: getattr(a, method).remote(*args) for nid, a in list(self.hosts.items())}
        out: dict[str, HostAnswer] = {}
        for nid, ref in refs.items():
            try:
                out[nid] = self.ray.get(ref, timeout=CALL_SECONDS)
            except Exception as e:  # noqa: BLE001
                self._drop(nid, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            self._say(nid, out[nid])
        return out

    # -- what the coordinator calls ------------------------------------------------------------------------------
    def start(self, should_stop=lambda: False) -> None:
        """One EngineHost per node, pinned to it; every node's server launched (launch mode) and healthy."""
        strategies = self.ray.util.scheduling_strategies
        for n in self._nodes:
            nid = n["NodeID"]
            self.hosts[nid] = self._cls.options(
                **self.hooks.placement(n, self.launch),  # (the server's resources, on its node)
                scheduling_strategy=strategies.NodeAffinitySchedulingStrategy(nid, soft=False),
            ).remote(str(self.lay.root), self.cfg, self.meta, self.launch, self.trust_server)
        refs = {nid: a.start.remote() for nid, a in self.hosts.items()}
        left = dict(refs)
        halted = False
        while left:
            ready, _ = self.ray.wait(list(left.values()), num_returns=1, timeout=0.5)
            if should_stop() and not halted:
                halted = True
                for a in self.hosts.values():
                    a.halt.remote()
            for ref in ready:
                nid = next(k for k, v in left.items() if v == ref)
                del left[nid]
                try:
                    ans: HostAnswer = self.ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the node went while its server was starting
                    self._drop(nid, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    continue
                self._say(nid, ans)
                if ans.error is not None:
                    self.stop()
                    where = f"node {nid[:12]}: "
                    raise UsageError(where + ans.error) if ans.usage else EngineError(where + ans.error)
                self.engines[nid] = ans.value
        if not self.hosts:
            raise EngineError("--ray: no node's server started (every node is gone)")

    def check(self, recorded: dict | None) -> dict:
        """Every node's server serves the build's model and layers; the first probe of the build (or this run's
        first node) is the reference the others must match."""
        found: dict | None = None
        for nid in list(self.hosts):
            ans = self._call(nid, "check", recorded or found, timeout=180.0)
            if ans is None:
                continue
            if ans.error is not None:
                raise (EngineRefused if ans.refused else EngineError)(f"node {nid[:12]}: {ans.error}")
            node_found, self.checks[nid] = ans.value
            found = found or node_found
        if found is None:
            raise EngineError("--ray: no node's server answered the probe (every node is gone)")
        self.model_name = found["model_id"]
        return {**found, "nodes": {nid[:12]: self.engines[nid].server for nid in self.hosts}}

    def watch(self) -> None:
        """(Re)start every node's health watch: silence counts from now (the answers polled before are void)."""
        self._all("watch")
        self._acted = time.monotonic()
        self._state = {}
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="hsbuild-ray-engines", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        """Every node's (healthy, silent seconds, restarts, staging files, staging bytes), asked here every
        STATE_SECONDS: the run loop reads the answers without waiting on a node (a node going away can take a
        while to answer)."""
        while self.hosts:
            t = time.monotonic()
            state = {nid: a.value for nid, a in self._all("state").items()}
            if t > self._acted:  # a poll begun before a watch, restart or kill is void
                self._state, self._asked = state, t
            for nid, st in state.items():
                self._restarts[nid] = st[2]
            time.sleep(max(0.0, STATE_SECONDS - (time.monotonic() - t)))

    def _states(self) -> dict[str, tuple]:
        """The last poll's answers of the nodes still here (none since `watch`: until the next poll)."""
        return {nid: st for nid, st in self._state.items() if nid in self.hosts}

    def healthy(self) -> bool:
        """Every node's server answered /health in a poll begun after the last restart or kill."""
        states = self._states()
        return self._asked > self._acted and bool(states) and all(st[0] for st in states.values())

    def unresponsive_for(self) -> float:
        return max((st[1] for st in self._states().values()), default=0.0)

    def kill_hung(self) -> None:
        """Kill (to restart) the server of each node that has not answered for about as long as the most silent
        one: the hung ones, not the healthy."""
        states = self._states()
        worst = max((st[1] for st in states.values()), default=0.0)
        for nid, st in states.items():
            if st[1] >= worst - 5.0:
                self._call(nid, "kill_hung")
        self._acted = time.monotonic()

    def restart_if_dead(self) -> bool:
        restarted = any(a.value for a in self._all("restart_if_dead").values())
        if restarted:
            self._acted = time.monotonic()
        return restarted

    @property
    def restarts(self) -> int:
        return sum(self._restarts.values())

    @property
    def server(self) -> str:
        return f"the servers of {len(self.hosts)} node(s)"

    def staging_usage(self) -> tuple[int, int]:
        states = self._states()  # (as of the last poll)
        return sum(st[3] for st in states.values()), sum(st[4] for st in states.values())

    def stop(self) -> None:
        """Stop every node's server (launch mode) and its health watch; then the actors."""
        self._all("stop")
        for a in self.hosts.values():
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        with self._hosts_lock:
            self.hosts.clear()  # (the poller ends)
        for nid in list(self.gone):  # a lost node's server may have left dumps of requests it was answering
            e = self.engines.get(nid)
            if e is not None:
                try:  # where this machine sees that node's folder (one machine, a shared filesystem)
                    clear_staging(Path(e.staging) / staging_name(self.meta))
                except OSError:
                    pass

    def worker_settings(self, settings, nid: str):
        """`settings` (the backend's worker settings) pointed at node `nid`'s server and the build's subfolder of
        its staging folder."""
        e = self.engines[nid]
        return self.hooks.settings_at(settings, e.server, str(Path(e.staging) / staging_name(self.meta)))

    def worker_check(self, nid: str):
        """The check node `nid`'s worker runs when that node's server comes back."""
        return self.checks.get(nid)

