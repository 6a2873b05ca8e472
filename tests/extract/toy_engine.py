"""A toy engine in one file: the proof that an engine is one plug-in (tests/extract/test_engine_plugin.py).

hsbuild finds it by an entry point alone (group `hsbuild.backends`: `toy = toy_engine`), with no edit anywhere
else. It holds what vLLM's package holds: its spec (`--backend toy`), its request path (ToyBackend), its server
command (`serve-command`, `run --launch`), its identity check (the listening process's command line, /v1/models)
and, as a script, the server itself:

    python toy_engine.py --host H --port P --staging DIR --ids 1,2,3,8 --hidden 256

an HTTP server on the standard library that answers `/health`, `/v1/models` and `/v1/completions` as an
OpenAI-compatible engine does, and writes each request's states into the file the request names inside its
staging folder (one subfolder deep), under a `.lock` held while it writes, as a real engine's connector does.
Its states are made up: `states(token_ids, ids, hidden)`, float32 [T, len(ids), H], slot i the "layer" ids[i].
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import queue
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from builder.errors import UsageError
from builder.extract.backends.base import Failure, Outcome, Request, States, Unavailable, check_finite
from builder.extract.backends.http_client import (
    EngineRejected,
    EngineUnavailable,
    ServerRefused,
    complete,
    served_model,
)
from builder.extract.backends.local_server import same_path, server_process
from builder.extract.backends.registry import BackendSpec, RunContext, register
from builder.extract.backends.serving import IdentityRequest, ServerEngine
from builder.extract.backends.staging import read_and_remove, remove_staged

SERVED_NAME = "toy"


def states(token_ids, ids: list[int], hidden: int):  # noqa: ANN001, ANN201 - (numpy in, numpy out)
    """The toy's states: a made-up function of each token id, slot (layer id) and hidden index."""
    import numpy as np  # noqa: PLC0415

    t = np.asarray(token_ids, dtype=np.int64)[:, None, None]
    layer = np.asarray(ids, dtype=np.int64)[None, :, None]
    h = np.arange(hidden, dtype=np.int64)[None, None, :]
    return (((t * 31 + layer * 7 + h) % 97).astype(np.float32) / 97) - 0.5


# -- the plan: the server's command ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ToyPlan:
    server: str
    staging: str
    ids: tuple[int, ...]
    hidden: int

    def argv(self) -> list[str]:
        from urllib.parse import urlparse  # noqa: PLC0415

        url = urlparse(self.server)
        return [sys.executable, os.path.abspath(__file__), "--host", url.hostname or "", "--port", str(url.port),
                "--staging", self.staging, "--ids", ",".join(map(str, self.ids)), "--hidden", str(self.hidden)]

    def env(self) -> dict[str, str]:
        return {}

    def at(self, server: str, staging: str) -> ToyPlan:
        return dataclasses.replace(self, server=server, staging=staging)


# -- the identity check ----------------------------------------------------------------------------------------

def parse(pid: int, argv: list[str]) -> dict | None:  # noqa: ARG001 - (server_process's parser)
    """What a toy server's command line says; None for any other command."""
    if not any(os.path.basename(a) == os.path.basename(__file__) for a in argv[:2]):
        return None
    opts = dict(zip(argv[2::2], argv[3::2], strict=False))
    return {"staging": opts.get("--staging"), "ids": [int(x) for x in opts.get("--ids", "").split(",") if x],
            "hidden": int(opts.get("--hidden", "0"))}


@dataclass(frozen=True)
class ToyIdentity:
    server: str
    staging: str
    ids: tuple[int, ...]
    hidden: int
    build_root: str
    model_name: str | None = None

    def check(self) -> dict:
        found = server_process(self.server, parse, "toy")
        fix = f"serve the build with the command `hsbuild serve-command {self.build_root}` prints"
        if isinstance(found, str):
            raise ServerRefused(f"{self.server}: cannot tell what it serves ({found}); {fix}")
        pid, conf = found
        problems = []
        if not same_path(conf["staging"], self.staging):
            problems.append(f"stages into {conf['staging']}, the build's staging folder is {self.staging}")
        if conf["ids"] != list(self.ids) or conf["hidden"] != self.hidden:
            problems.append(f"serves ids {conf['ids']} of width {conf['hidden']}, the build's are "
                            f"{list(self.ids)} of width {self.hidden}")
        if problems:
            raise ServerRefused(f"{self.server} (pid {pid}) " + "; ".join(problems) + f"; {fix}")
        m = served_model(self.server)
        if self.model_name is not None and m.id != self.model_name:
            raise ServerRefused(f"{self.server}: now serves {m.id!r}, this run sends {self.model_name!r}")
        return {"model_id": m.id, "root": m.root, "process": {"pid": pid, **conf}}

    def confirmed(self, found: dict) -> ToyIdentity:
        return dataclasses.replace(self, model_name=found["model_id"])


class ToyServer(ServerEngine):
    def plan(self, cfg, meta: dict) -> ToyPlan:  # noqa: ANN001 - (BuildConfig)
        return ToyPlan(server=cfg.server or "", staging=str(Path(cfg.staging or "").absolute()),
                       ids=tuple(meta["toy_layer_ids"]), hidden=int(meta["hidden_size"]))

    def identity(self, request: IdentityRequest) -> ToyIdentity:
        plan: ToyPlan = request.plan  # type: ignore[assignment]
        return ToyIdentity(server=plan.server, staging=plan.staging, ids=plan.ids, hidden=plan.hidden,
                           build_root=request.build_root)


# -- the request path ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToySettings:
    server: str
    staging: str  # the build's own subfolder of the server's staging folder
    model_name: str
    ids: list[int]
    aux_layers: list[int]
    num_layers: int
    dtype: str
    inflight: int


class ToyBackend:
    name = "toy"

    def __init__(self, settings: ToySettings):
        self.s = settings
        self.capacity = settings.inflight
        self.pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="toy")
        self.results: queue.Queue[Outcome] = queue.Queue()
        self._n = 0
        self._lock = threading.Lock()
        Path(settings.staging).mkdir(exist_ok=True)

    def submit(self, request: Request) -> None:
        with self._lock:
            self._n += 1
        self.pool.submit(lambda: self.results.put(self._one(request)))

    def collect(self, timeout: float) -> list[Outcome]:
        out: list[Outcome] = []
        try:
            out.append(self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait())
            while True:
                out.append(self.results.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            self._n -= len(out)
        return out

    def in_flight(self) -> int:
        with self._lock:
            return self._n

    def abandon_waiting(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _one(self, r: Request) -> Outcome:
        import torch  # noqa: PLC0415

        from builder.store.dtypes import torch_dtype  # noqa: PLC0415

        ids = [int(x) for x in r.input_ids.tolist()]
        path = Path(self.s.staging) / f"{uuid.uuid4().hex}.safetensors"
        try:
            complete(self.s.server, self.s.model_name, ids, 60.0, {"path": str(path)})
            data = read_and_remove(path, 30.0)
        except EngineUnavailable as e:
            remove_staged(path)
            return Unavailable(r.key, str(e))
        except EngineRejected as e:
            return Failure(r.key, "rejected", str(e))
        if data["token_ids"].tolist() != ids:
            return Failure(r.key, "token_mismatch", "the toy server's token ids differ from the request's")
        hs = data["hidden_states"].to(torch_dtype(self.s.dtype))
        aux = torch.cat([hs[:, self.s.ids.index(i), :] for i in self.s.aux_layers], dim=-1).contiguous()
        final = hs[:, self.s.ids.index(self.s.num_layers), :].contiguous()
        return check_finite(r.key, aux, final) or States(r.key, aux, final)


# -- the spec ----------------------------------------------------------------------------------------------------

def _check_init(ex) -> dict:  # noqa: ANN001 - (Extractor or ModelInfo)
    if any(i >= ex.num_layers for i in ex.aux_layers):
        raise UsageError(f"--aux-layers {ex.aux_layers}: the toy serves ids below {ex.num_layers}")
    return {"toy_layer_ids": sorted(set(ex.aux_layers) | {ex.num_layers})}


def _settings(ctx: RunContext) -> ToySettings:
    cfg, meta = ctx.cfg, ctx.meta
    return ToySettings(server=cfg.server or "", staging=ctx.staging_dir, model_name=ctx.model_name,
                       ids=list(meta["toy_layer_ids"]), aux_layers=list(meta["aux_layers"]),
                       num_layers=int(meta["num_layers"]), dtype=cfg.dtype,
                       inflight=int(BACKEND.setting(cfg, "inflight")))


def _open(settings, recheck=None):  # noqa: ANN001, ANN202, ARG001 - (WorkerSettings; it checks nothing again)
    from builder.extract.model import Extractor  # noqa: PLC0415

    ex = Extractor(settings.model, settings.aux_layers or None, settings.dtype, "cpu", load_weights=False)
    return ex, ToyBackend(settings.backend_settings)


BACKEND = register(BackendSpec(
    name="toy", summary="a toy server makes up the states", open=_open, server=ToyServer(), device="cpu",
    final_state="pre_norm", options={"server": None, "inflight": 2}, check_init=_check_init,
    worker_settings=_settings))


# -- the server ------------------------------------------------------------------------------------------------

def serve(host: str, port: int, staging: str, ids: list[int], hidden: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    root = os.path.realpath(staging)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # noqa: ANN002 - (quiet)
            pass

        def _answer(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - (http.server's name)
            if self.path == "/health":
                self._answer(200, {})
            elif self.path == "/v1/models":
                self._answer(200, {"data": [{"id": SERVED_NAME, "root": SERVED_NAME}]})
            else:
                self._answer(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = (doc.get("kv_transfer_params") or {}).get("path", "")
            if os.path.dirname(os.path.realpath(os.path.dirname(path))) != root or doc.get("model") != SERVED_NAME:
                self._answer(400, {"error": f"not a file one folder deep in {root}, or not model {SERVED_NAME}"})
                return
            tokens = np.asarray(doc["prompt"], dtype=np.int64)
            fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
            try:  # the lock is held while the file is written: a reader takes it shared once it is complete
                fcntl.flock(fd, fcntl.LOCK_EX)
                save_file({"token_ids": tokens, "hidden_states": states(tokens, ids, hidden)}, path)
            finally:
                os.close(fd)
            self._answer(200, {"choices": [{"text": ""}], "kv_transfer_params": {"path": path}})

    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for flag in ("--host", "--port", "--staging", "--ids", "--hidden"):
        ap.add_argument(flag, required=True)
    a = ap.parse_args()
    serve(a.host, int(a.port), a.staging, [int(x) for x in a.ids.split(",")], int(a.hidden))
