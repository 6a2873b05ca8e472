"""Starting the run's workers and keeping hold of them: local processes (forked from the server that imported
torch, or spawned: builder/run/worker_start.py; or taken from those started before the run:
builder/run/standby.py), or actors on a Ray cluster (--ray: builder/run/ray_pool.py), one a node for `auto`.

`Workers` owns them: the standby, the Ray pool, each worker's process (or actor handle) and the run's end of its
pipe, the run-wide flags they share (stop, writers' gate), and the count. The rest of the run asks it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from builder.errors import UsageError
from builder.extract.threads import fix_threading
from builder.log.events import Event, detail
from builder.run.messages import WorkerSettings
from builder.run.preparation import RAY_CPUS_PER_WORKER
from builder.run.standby import Flags, Standby, start_ignoring_stop_signals, worker_entry
from builder.run.worker_start import forked

if TYPE_CHECKING:
    from builder.log.session import OwnerSession
    from builder.run.preparation import Prepared


class Workers:
    """The run's workers (see the module's docstring). Made once the run holds the build: local workers are
    taken from the prepared standby or started now, so that their imports overlap the source, the plan and the
    preflight. `close` stops what was not taken and disconnects from the cluster."""

    def __init__(self, prep: Prepared, run_id: str, session: OwnerSession, echo: Callable[[str], None]):
        self._prep, self._run_id, self._session, self._echo = prep, run_id, session, echo
        self._count = prep.workers  # 0 until counted on the cluster (--ray, auto)
        self._why = prep.workers_why
        self._standby: Standby | None = prep.standby
        if self._standby is None and not prep.opts.ray:
            self._standby = Standby(prep.workers, preload_hf=prep.preload_hf)
        if self._standby is not None:  # its workers hold the run's flags since they were started
            self._ctx, self.flags = self._standby.ctx, self._standby.flags
        else:  # (Ray's workers are actors: no fork server for them)
            fix_threading()  # (the standby sets it for its workers: read when torch loads)
            self._ctx = mp.get_context("spawn")
            self.flags = Flags(self._ctx)
        self._connected = None  # a RayPool connected (to count the nodes for `auto`), not yet probed
        self._pool = None  # the Ray worker pool, once probed
        self._procs: dict[int, mp.process.BaseProcess] = {}  # (or RayWorker handles, which look like one)
        self._conns: dict[int, Connection] = {}  # the run's end of each worker's pipe: its reports come here
        self._by_node: dict[str, list] = {}  # --ray with a server backend: node id -> its worker(s)

    @property
    def count(self) -> int:
        """How many workers the run has: those started, once they are (on Ray with a server backend, one a node
        whose server is up); until then, how many it will start."""
        return len(self._procs) or self._count

    @property
    def why(self) -> str | None:
        """What `auto` sized the count from (said, and recorded in run_started); None for a count given."""
        return self._why

    def size_on_cluster(self) -> None:
        """`--workers auto` with --ray: one worker a live node of the cluster (connecting to it now; the nodes'
        preflight comes with the pool, after `run_started`)."""
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        self._connected = RayPool(self._prep.opts.ray, RAY_CPUS_PER_WORKER)
        nodes = len(self._connected.nodes())
        self._count = max(1, nodes)
        self._why = f"one a live node of the Ray cluster, {nodes} (--workers N for more)"

    def at_least_one(self) -> None:
        """Nothing to do, no cluster asked: the count the run records is still one."""
        self._count = max(1, self._count)

    def ray_pool(self):  # noqa: ANN201 - a RayPool
        """The Ray cluster's worker pool (--ray), after checking every node sees the build directory (once)."""
        if self._pool is not None:
            return self._pool
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        prep = self._prep
        pool, self._connected = self._connected or RayPool(prep.opts.ray, RAY_CPUS_PER_WORKER), None
        # a server backend's GPUs are the servers', not hsbuild's (as in the local preflight)
        problems, warnings = pool.probe(prep.lay.root, self._run_id, prep.compute_device)
        for w in warnings:
            self._echo(f"warning: {w}")
        if problems:
            pool.close()
            raise UsageError(f"--ray {prep.opts.ray}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self._session.emit(Event("nodes_probed", detail=detail(nodes=[n["NodeID"] for n in pool.nodes()])))
        self._pool = pool
        return pool

    def start(self, settings: WorkerSettings, node: str | None = None) -> Connection:
        """A worker with these settings: a local process (spawned, its stop signals ignored), or an actor on the
        Ray cluster whose handle looks like one (builder/run/ray_pool.py), on `node` (its server's). Returns the
        run's end of its pipe."""
        w = settings.worker
        if self._prep.opts.ray:
            handle = self.ray_pool().start(settings, self.flags, w, node=node)
            pl = handle.placement
            self._session.emit(Event("worker_placed", worker=w,
                                     detail=detail(node=pl.node_id, host=pl.host, pid=pl.pid)))
            self._echo(f"worker {w}: Ray actor on node {pl.node_id[:12]} ({pl.host}, pid {pl.pid})")
            proc, conn = handle, handle.conn
        else:
            proc, conn = self._standby.take(w, settings) or self._spawn(settings)
        self._procs[w], self._conns[w] = proc, conn
        if node is not None:
            self._by_node.setdefault(node, []).append(proc)
        return conn

    def _spawn(self, settings: WorkerSettings) -> tuple[mp.process.BaseProcess, Connection]:
        ctx = self._ctx
        mine, theirs = ctx.Pipe(duplex=True)
        p = ctx.Process(target=worker_entry, args=(settings, theirs, self.flags, dict(os.environ)), daemon=True,
                        name=f"hsbuild-worker-{settings.worker}")
        start_ignoring_stop_signals(p, forked(ctx))  # (starts it)
        theirs.close()  # so a dead worker's pipe reads as EOF here
        return p, mine

    # -- one worker ----------------------------------------------------------------------------------------------
    def conn(self, w: int) -> Connection:
        """The run's end of worker `w`'s pipe (its reports; EOF once it is gone)."""
        return self._conns[w]

    def readable(self, ws: list[int], timeout: float) -> list[int]:
        """Those of workers `ws` with something to read (a report, or EOF), waiting at most `timeout` s."""
        ready = mp_connection.wait([self._conns[w] for w in ws], timeout=timeout)
        return [w for w in ws if self._conns[w] in ready]

    def exited(self, w: int) -> bool:
        return not self._procs[w].is_alive()

    def exit_code(self, w: int) -> int | None:
        """Worker `w`'s exit code, once it is gone (waited for at most 5 s)."""
        p = self._procs[w]
        p.join(timeout=5)
        return p.exitcode

    def lost(self, w: int) -> str | None:
        """Why worker `w`'s actor or node is gone (Ray; not its sample's fault), None for a worker that died."""
        return getattr(self._procs[w], "lost", None)

    def pid(self, w: int) -> int | None:
        return self._procs[w].pid

    def kill(self, w: int) -> None:
        """SIGKILL (a Ray actor: killed), and waited for."""
        p = self._procs[w]
        p.kill()
        p.join(timeout=5)

    def running(self) -> list[int]:
        return [w for w, p in self._procs.items() if p.is_alive()]

    def drop_nodes(self, gone: dict[str, str]) -> None:
        """--ray with an engine backend: a node whose server's host is gone (its EngineHost actor died, the node
        may live on) leaves its worker with no server: that worker is stopped, so it is lost like one on a lost
        node (its samples back to pending), rather than failing every request and pausing the run again and
        again."""
        for nid, why in gone.items():
            for proc in self._by_node.pop(nid, []):
                if proc.is_alive():
                    proc.lose(f"the host of node {nid[:12]}'s server is gone ({why})")

    def join_or_kill(self, seconds: float) -> None:
        """Join every worker within one shared deadline; kill the rest (safe: nothing they have not reported is
        referenced)."""
        deadline = time.monotonic() + seconds
        for p in self._procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def close(self) -> None:
        """The standby workers not taken stopped (nothing to do, a refusal, an error); the cluster disconnected
        (after the servers on it: the supervisor stops those first). Once; later calls do nothing."""
        standby, self._standby = self._standby, None
        pools, self._pool, self._connected = (self._pool, self._connected), None, None
        try:
            if standby is not None:
                standby.close()
        finally:
            for pool in pools:
                if pool is not None:
                    pool.close()
