"""Starting the run's workers: local processes (forked from the server that imported torch, or spawned:
builder/run/worker_start.py; or taken from those the CLI started before the run:
builder/run/standby.py), or actors on a Ray cluster (--ray: builder/run/ray_pool.py), one a node for `auto`;
and how many intra-op threads each gets. Part of the Coordinator (builder/run/coordinator.py).
"""

from __future__ import annotations

import os

from builder.errors import UsageError
from builder.log.events import Event, detail
from builder.run.messages import WorkerSettings
from builder.run.sizing import usable_cpus
from builder.run.standby import Flags, Standby, loads_hf_model, start_ignoring_stop_signals, worker_entry
from builder.run.worker_start import forked

RAY_CPUS_PER_WORKER = float(os.environ.get("HSBUILD_RAY_CPUS", "1"))  # CPUs a Ray worker's actor reserves


class SpawningMixin:
    """(Mixed into Coordinator: uses its options, worker count, events and echo.)"""

    def _standby(self) -> Standby | None:
        """The run's local workers, spawned now so that their imports overlap the source, the plan and the
        preflight (or the CLI's, spawned before the coordinator was even imported). None with --ray."""
        given = self.opts.standby
        if given is not None and (self.opts.ray or given.workers != self.workers):
            given.close()
            given = None
        if given is not None or self.opts.ray:
            return given
        return Standby(self.workers, preload_hf=loads_hf_model(self.cfg, self.backend))

    def _size_on_cluster(self) -> None:
        """`--workers auto` with --ray: one worker a live node of the cluster (connecting to it now; the nodes'
        preflight comes with the pool, after `run_started`)."""
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        self._ray_connected = RayPool(self.opts.ray, RAY_CPUS_PER_WORKER)
        nodes = len(self._ray_connected.nodes())
        self.workers = max(1, nodes)
        self.workers_why = f"one a live node of the Ray cluster, {nodes} (--workers N for more)"

    def _threads(self) -> int:
        """Intra-op threads of each worker. Recorded in `run_started`: on the CPU, a forward pass's last bits can
        depend on how its reductions were split, so the same sample extracted with another thread count may
        differ by an ulp (both are the model's output; a bit-exact comparison must use the same count). A Ray
        worker gets the CPUs its actor reserves (RAY_CPUS_PER_WORKER)."""
        if self.opts.ray:
            return max(1, int(RAY_CPUS_PER_WORKER))
        return max(1, usable_cpus() // max(1, self.workers))

    def _start_worker(self, ctx, settings: WorkerSettings, flags: Flags, pool, node: str | None = None) -> tuple:
        """A worker: a local process (spawned, its stop signals ignored), or an actor on the Ray cluster whose
        handle looks like one (builder/run/ray_pool.py). Returns (process, the coordinator's end of its pipe)."""
        if pool is not None:
            handle = pool.start(settings, flags, settings.worker, node=node)
            pl = handle.placement
            self.emit(Event("worker_placed", worker=settings.worker,
                            detail=detail(node=pl.node_id, host=pl.host, pid=pl.pid)))
            self.echo(f"worker {settings.worker}: Ray actor on node {pl.node_id[:12]} ({pl.host}, pid {pl.pid})")
            return handle, handle.conn
        ready = self.standby.take(settings.worker, settings) if self.standby is not None else None
        if ready is not None:
            return ready
        mine, theirs = ctx.Pipe(duplex=True)
        p = ctx.Process(target=worker_entry, args=(settings, theirs, flags, dict(os.environ)), daemon=True,
                        name=f"hsbuild-worker-{settings.worker}")
        start_ignoring_stop_signals(p, forked(ctx))  # (starts it)
        theirs.close()  # so a dead worker's pipe reads as EOF here
        return p, mine

    def _ray_pool(self):
        """The Ray cluster's worker pool (--ray), after checking every node sees the build directory."""
        from builder.run.ray_pool import RayPool  # noqa: PLC0415

        pool, self._ray_connected = self._ray_connected or RayPool(self.opts.ray, RAY_CPUS_PER_WORKER), None
        # a server backend's GPUs are the servers', not hsbuild's (as in the local preflight)
        device = self.backend.device or self.opts.device or self.cfg.device
        problems, warnings = pool.probe(self.lay.root, self.run_id, device)
        for w in warnings:
            self.echo(f"warning: {w}")
        if problems:
            pool.close()
            raise UsageError(f"--ray {self.opts.ray}: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.emit(Event("nodes_probed", detail=detail(nodes=[n["NodeID"] for n in pool.nodes()])))
        return pool
