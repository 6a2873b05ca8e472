"""Workers as Ray actors, for a build filled by several nodes (`hsbuild run BUILD --ray auto|ADDRESS`).

The coordinator stays the one owner of the event log, on the driver's node, and talks to every worker through a
local pipe exactly as it talks to a local worker process: a `RayWorker` handle looks like a process
(`is_alive`, `kill`, `join`, `exitcode`, `pid`) and owns the coordinator's end of a local pipe. Two bridge
threads carry the messages between that pipe and the actor (`WorkerActor`), whose own thread runs the very
worker loop a local process runs (builder/run/worker.py), writing its segment straight into the shared build
directory. The run-wide flags (stop, gate) are copied to the actor when they change.

An actor that dies (its node removed, its process killed) closes its handle's pipe: the coordinator sees the
worker gone (`worker_lost`), its samples go back to pending, and the run goes on with the others. Ray
retries nothing on its own: actors have max_restarts=0 and max_task_retries=0 (Ray's defaults for some
retries are infinite).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from builder.errors import ClusterUnreachableError, UsageError

TAKE_SECONDS = 0.5  # an uplink call waits this long for the worker's next messages
FLAG_POLL_SECONDS = 0.05  # how often the run-wide flags are compared and copied to the actor


def ray_module():
    """Ray, or a UsageError saying how to install it."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise UsageError("--ray: Ray is not installed; `pip install 'hsbuild[ray]'`") from None
    return ray


def check_address(address: str) -> str:
    """`auto` or HOST:PORT (a Ray cluster's GCS address), else a UsageError naming --ray."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or (sep and host and port.isdigit() and 0 < int(port) < 65536):
        return address
    raise UsageError(f"--ray '{address}': use auto (the cluster this node belongs to) or HOST:PORT of its head "
                     "node, e.g. 127.0.0.1:6379")


@dataclass(frozen=True)
class Placement:
    """Where a worker runs."""

    node_id: str
    host: str
    pid: int


class _ActorConn:
    """The worker loop's end of its 'pipe' inside the actor: tasks come in through `inbox` (the `put` calls),
    reports go out through `outbox` (the `take` calls)."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._peeked: list = []  # what `poll` took out of the inbox (only the worker's thread receives)

    def send(self, msg: object) -> None:
        self.outbox.put(msg)

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._peeked:
            return True
        try:  # None: wait for one, as Connection.poll(None) does
            self._peeked.append(self.inbox.get(timeout=timeout) if timeout is None or timeout > 0
                                else self.inbox.get_nowait())
        except queue.Empty:
            return False
        return True

    def recv(self) -> object:
        return self._peeked.pop(0) if self._peeked else self.inbox.get()


class _ThreadFlags:
    """The run-wide flags as the actor's worker thread reads them (set by `WorkerActor.set_flags`)."""

    def __init__(self) -> None:
        self.stop = False
        self.gate_open = True


@dataclass
class NodeReport:
    """What one node found in the run's preflight (`node_preflight`)."""

    host: str
    write_error: str | None  # writing the probe file into the build directory failed
    lock_free: bool | None  # True: this node could take hsbuild.lock while the driver holds it; None: not tried
    lock_error: str | None
    gpu_checks: list[dict]  # builder.doctor.checks.check_gpus on this node, as dicts


def node_preflight(build_root: Path, probe_path: Path, device: str) -> NodeReport:
    """Run on every node before its workers start, while the driver holds the build lock: write a probe file
    into the build directory (the driver then reads it back); try to take `hsbuild.lock` without blocking (it
    must be busy: taken here, flock would not exclude a second run from this node); run doctor's GPU checks
    for the build's device."""
    from builder.config import load_config  # noqa: PLC0415
    from builder.doctor.checks import Context, check_gpus  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.lock import flock_held  # noqa: PLC0415

    host = socket.gethostname()
    write_error = None
    try:
        probe_path.write_text(f"{host} {os.getpid()}\n")
    except OSError as e:
        write_error = str(e)
    lay = layout(build_root)
    lock_free, lock_error = None, None
    try:
        fd = os.open(lay.lock, os.O_RDWR)
    except OSError as e:
        lock_error = f"cannot open {lay.lock}: {e}"
    else:
        try:
            lock_free = not flock_held(fd)
        except OSError as e:  # flock refused outright (ENOLCK: an NFS mount without lock support, ...)
            lock_error = f"flock on {lay.lock}: {e}"
        finally:
            os.close(fd)
    gpu_checks: list[dict] = []
    try:
        ctx = Context(lay=lay, cfg=load_config(lay), device=device, own_pids={os.getpid()}, for_run=True)
        gpu_checks = [c.as_dict() for c in check_gpus(ctx)]
    except Exception as e:  # noqa: BLE001 - a node that cannot even inspect its GPUs
        gpu_checks = [{"name": "gpu", "status": "fail", "summary": f"GPU checks failed on {host}: {e}",
                       "fix": None}]
    return NodeReport(host, write_error, lock_free, lock_error, gpu_checks)


class WorkerActor:
    """A worker hosted by a Ray actor (decorated with ray.remote by `RayPool`). Its thread runs the worker loop;
    the methods are called concurrently (a threaded actor)."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.conn = _ActorConn()
        self.flags = _ThreadFlags()
        self.thread = threading.Thread(target=self._run, name="hsbuild-worker", daemon=True)

    def _run(self) -> None:
        from builder.run.worker import run_hosted  # noqa: PLC0415

        try:
            run_hosted(self.settings, self.conn, self.flags)
        finally:
            self.conn.outbox.put(None)  # the end: the uplink sees the worker finished

    def start(self) -> Placement:
        import ray  # noqa: PLC0415

        self.thread.start()
        return Placement(ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid())

    def put(self, msgs: list) -> None:
        for m in msgs:
            self.conn.inbox.put(m)

    def set_flags(self, stop: bool, gate_open: bool) -> None:
        self.flags.stop, self.flags.gate_open = stop, gate_open

    def take(self, timeout: float) -> list:
        """The worker's messages so far (waiting up to `timeout` for the first); None last once it ended."""
        out: list = []
        try:
            out.append(self.conn.outbox.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.conn.outbox.get_nowait())
            except queue.Empty:
                return out

    def preflight(self, build_root: str, probe_path: str, device: str) -> NodeReport:
        return node_preflight(Path(build_root), Path(probe_path), device)


class RayWorker:
    """The coordinator's handle on one actor: process-like, with the coordinator's end of a local pipe
    (`conn`). Bridge threads: uplink (actor -> pipe), downlink (pipe -> actor), flags (Flags -> actor)."""

    def __init__(self, actor, flags, worker: int):
        import ray  # noqa: PLC0415

        self._ray, self.actor, self.flags, self.worker = ray, actor, flags, worker
        self.conn, self._theirs = mp.Pipe()
        self.exitcode: int | None = None
        self.placement: Placement | None = None
        self.lost: str | None = None  # why the actor is gone, when it did not end by itself
        self._done = threading.Event()
        self.pid = None

    def start(self, timeout: float = 300.0) -> Placement:
        self.placement = self._ray.get(self.actor.start.remote(), timeout=timeout)
        self.pid = self.placement.pid
        for fn, name in ((self._uplink, "up"), (self._downlink, "down"), (self._flag_sync, "flags")):
            threading.Thread(target=fn, name=f"hsbuild-ray-{self.worker}-{name}", daemon=True).start()
        return self.placement

    @property
    def name(self) -> str:
        return f"ray-worker-{self.worker}"

    def _end(self, code: int, lost: str | None = None) -> None:
        if self._done.is_set():
            return
        # a reason given before the actor was killed (`kill`: its server's host is gone) is the cause; the
        # uplink's ActorDiedError that the kill then raises is only its symptom
        self.exitcode, self.lost = code, self.lost or lost
        self._done.set()
        try:
            self._theirs.close()  # the coordinator reads EOF after the messages already passed on
        except OSError:
            pass

    def _uplink(self) -> None:
        while not self._done.is_set():
            try:
                msgs = self._ray.get(self.actor.take.remote(TAKE_SECONDS))
            except Exception as e:  # noqa: BLE001 - RayActorError, node lost, ... : the worker is gone
                self._end(-9, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                return
            for m in msgs:
                if m is None:
                    self._end(0)
                    return
                try:
                    self._theirs.send(m)
                except OSError:
                    self._end(-9, "pipe closed")
                    return

    def _downlink(self) -> None:
        while not self._done.is_set():
            try:
                if not self._theirs.poll(0.2):
                    continue
                msg = self._theirs.recv()
            except (EOFError, OSError):
                return
            try:
                self.actor.put.remote([msg])  # in order: one caller, Ray keeps a caller's calls in order
            except Exception:  # noqa: BLE001 - the actor is gone: the uplink notices
                return

    def _flag_sync(self) -> None:
        last = None
        while not self._done.is_set():
            now = (bool(self.flags.stop), bool(self.flags.gate_open))
            if now != last:
                try:
                    self.actor.set_flags.remote(*now)
                except Exception:  # noqa: BLE001
                    return
                last = now
            time.sleep(FLAG_POLL_SECONDS)

    # -- process-like -------------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._end(-9, self.lost or "killed")

    def lose(self, why: str) -> None:
        """Kill the actor because what it needs is gone (its node's server): it is lost for `why`, not dead."""
        self.lost = why
        self.kill()


def worker_env(fixed: dict[str, str]) -> dict[str, str]:
    """An actor's environment variables: the fixed threading, and the driver's HSBUILD_* settings (a Ray
    worker process inherits its raylet's environment, not the driver's)."""
    return {**{k: v for k, v in os.environ.items() if k.startswith("HSBUILD_")}, **fixed}


CONNECT_TIMEOUT_S = 10.0  # a cluster's head that does not accept a connection in this long is not there


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """HOST:PORT accepts a TCP connection within `timeout` s, else ClusterUnreachableError naming the address
    (Ray's own client retries a silent address for minutes). `auto` is Ray's to find (it fails fast)."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ClusterUnreachableError(
            f"--ray {address}: no Ray cluster answers there ({e.strerror or type(e).__name__}, waited at most "
            f"{timeout:g} s); start one with `ray start --head --node-ip-address=HOST --port={port}` on that host, "
            "or give the address `ray status` prints on a node of the cluster") from None


class RayPool:
    """Starts workers as actors on a Ray cluster (`address`: 'auto' or host:port), one per `resources` slot."""

    def __init__(self, address: str, cpus_per_worker: float = 1.0):
        ray = ray_module()
        self.ray = ray
        self._owned = not ray.is_initialized()  # connected here: disconnected by `close`
        if self._owned:
            check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=False, include_dashboard=False)
            except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, ...
                raise UsageError(f"--ray {address}: cannot connect to a Ray cluster ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}); start one with `ray start --head` "
                                 "or give its address") from None
        self.cpus = cpus_per_worker
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(WorkerActor)

    def close(self) -> None:
        """Disconnect from the cluster if this pool connected (the cluster itself goes on)."""
        if self._owned and self.ray.is_initialized():
            self.ray.shutdown()

    def nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def start(self, settings, flags, worker: int, node: str | None = None) -> RayWorker:
        """A worker actor: spread over the nodes, or on `node` (the node of the server it talks to)."""
        from builder.extract.threads import FIXED_THREADING  # noqa: PLC0415

        strategy = ("SPREAD" if node is None else
                    self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False))
        actor = self._actor_cls.options(num_cpus=self.cpus, scheduling_strategy=strategy,
                                        runtime_env={"env_vars": worker_env(FIXED_THREADING)}).remote(settings)
        handle = RayWorker(actor, flags, worker)
        handle.start()
        return handle

    def probe(self, build_root: Path, run_id: str, device: str) -> tuple[list[str], list[str]]:
        """The preflight of every node (`node_preflight`): the build directory is one shared filesystem (a file
        written from each node is seen here), the build lock holds across nodes, each node's GPUs pass doctor's
        checks. Returns (problems: the run must not start, warnings)."""
        problems: list[str] = []
        warnings: list[str] = []
        probe = self.ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor)
        for n in self.nodes():
            nid = n["NodeID"]
            strategy = self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(nid, soft=False)
            actor = probe.options(num_cpus=0, scheduling_strategy=strategy).remote(None)
            path = Path(build_root) / f".probe-{run_id}-{nid[:12]}"
            try:
                rep: NodeReport = self.ray.get(actor.preflight.remote(str(build_root), str(path), device),
                                               timeout=120)
                name = f"node {nid[:12]} ({rep.host})"
                if rep.write_error is not None:
                    problems.append(f"{name} cannot write {path}: {rep.write_error}")
                elif not path.is_file():
                    problems.append(f"{name} wrote {path}, but this node does not see it: the build directory "
                                    "must be one shared filesystem, mounted at the same path on every node")
                if rep.lock_free:
                    problems.append(f"{name} could take hsbuild.lock while this run holds it: flock on this "
                                    "filesystem does not exclude other hosts (see `hsbuild doctor`, storage.locking)")
                elif rep.lock_error:
                    warnings.append(f"{name}: {rep.lock_error}")
                for c in rep.gpu_checks:
                    if c["status"] == "fail":
                        problems.append(f"{name}: {c['summary']}" + (f"; fix: {c['fix']}" if c.get("fix") else ""))
                    elif c["status"] == "warn":
                        warnings.append(f"{name}: {c['summary']}")
            finally:
                self.ray.kill(actor, no_restart=True)
                path.unlink(missing_ok=True)
        return problems, warnings
