"""The vLLM backend: forward passes in a running vLLM server, states ingested from its staging folder.

Upstream protocol, no engine patch: the server runs the speculative method `extract_hidden_states` with
`eagle_aux_hidden_state_layer_ids` = the build's engine layer ids and the KV connector
`ExampleHiddenStatesConnector` writing to the staging folder (`hsbuild serve-command BUILD` prints the
command). Each sample is one `POST /v1/completions` (prompt = its token ids, max_tokens 1); the answer names
`kv_transfer_params.hidden_states_path`, a `{request_id}.safetensors` file (`token_ids` int64 [T],
`hidden_states` [T, n_ids, H], slots in ascending id order) next to a `.lock` the server holds (flock) until the
file is complete.

Ingestion: a watchdog observer on the staging folder wakes the requests waiting for their file; a file is
ready when its lock can be taken shared. It is read, validated (token ids equal the request's, shape, dtype,
finite), its final slot put in the build's convention, and deleted with its lock at once: the states live in
the worker's group until they are durable, so at most `capacity` staging files exist and none outlives a
crash as something a later run would trust (each run clears what earlier ones left).

Layer ids: engine id k < L is Hugging Face `hidden_states[k]`; id L is the last decoder layer's output BEFORE
the final norm (Hugging Face's `hidden_states[L]` is after it).
"""

from __future__ import annotations

import fcntl
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from builder.extract.backends.base import (
    Failure,
    Outcome,
    Request,
    States,
    Unavailable,
    check_finite,
)
from builder.extract.backends.engine import EngineRejected, EngineUnavailable, complete, healthy
from builder.extract.final_norm import FinalNorm

STAGING_SUFFIX = ".safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def engine_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """The ids the server is asked for: the aux layers (HF indices < L, the same ids in vLLM) and L."""
    return sorted(set(aux_layers) | {num_layers})


@dataclass(frozen=True)
class VllmSettings:
    server: str
    model_name: str  # the id the server serves the model under (its /v1/models)
    staging: str
    aux_layers: list[int]
    num_layers: int
    hidden_size: int
    dtype: str  # bfloat16, float16, float32: what the server must return
    final_state: str  # post_norm | pre_norm: what the build stores as hidden_state
    inflight: int = 16
    request_timeout: float = 600.0  # one prefill of the longest sample, queued behind `inflight` others
    file_timeout: float = 120.0  # from the answer to a complete staging file


class _Wakeup:
    """Threads waiting for staging files sleep here; watchdog events (and a slow tick) wake them."""

    def __init__(self, staging: Path):
        self.cond = threading.Condition()
        self.observer = None
        try:
            from watchdog.events import FileSystemEventHandler  # noqa: PLC0415
            from watchdog.observers import Observer  # noqa: PLC0415

            wake = self

            class _Handler(FileSystemEventHandler):
                def on_any_event(self, event) -> None:  # noqa: ANN001
                    wake.notify()

            self.observer = Observer()
            self.observer.schedule(_Handler(), str(staging), recursive=False)
            self.observer.daemon = True
            self.observer.start()
        except Exception:  # noqa: BLE001 - no inotify (some network filesystems): the tick alone wakes them
            self.observer = None

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)

    def stop(self) -> None:
        if self.observer is not None:
            self.observer.stop()
            self.observer.join(timeout=5)


def remove_staged(path: Path | str) -> None:
    """Delete a staging file and its lock (either may be gone already)."""
    for q in (Path(path), Path(str(path) + ".lock")):
        q.unlink(missing_ok=True)


def staging_usage(staging: Path) -> tuple[int, int]:
    """(files, bytes) in the staging folder now."""
    files = size = 0
    for p in staging.glob("*" + STAGING_SUFFIX):
        try:
            size += p.stat().st_size
            files += 1
        except FileNotFoundError:
            pass
    return files, size


def clear_staging(staging: Path) -> int:
    """Remove staging files no server is writing (their lock can be taken): what crashed runs left. Returns
    how many were removed. Files whose lock is held belong to a request still being written; left alone."""
    removed = 0
    for p in sorted(staging.glob("*" + STAGING_SUFFIX)):
        lock = Path(str(p) + ".lock")
        try:
            fd = os.open(lock, os.O_RDONLY) if lock.exists() else None
        except OSError:
            fd = None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
            remove_staged(p)
            removed += 1
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def read_when_ready(path: Path | str, timeout: float, wait=lambda s: time.sleep(min(s, 0.05))) -> dict:
    """Wait until the server released the staging file's lock (`wait(seconds)` sleeps until something may
    have changed: the backend's watchdog wakeup), then read it. EngineUnavailable when the server died before
    the file was complete, or never wrote it."""
    from safetensors.torch import load  # noqa: PLC0415

    path = Path(path)
    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout
    while True:
        fd = None
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            if not path.exists():  # (a file written without a lock is complete once it reads)
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"{path}: never appeared in the staging folder within {timeout:g} s "
                                            "(did the server die?)") from None
                wait(0.2)
                continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EngineUnavailable(f"{path}: still locked by the server after {timeout:g} s") from None
                    wait(0.2)
                    continue
            if not path.exists():  # lock released but no file: the writer died
                raise EngineUnavailable(f"{path}: the server released its lock without writing the file (it "
                                        "died, or its write failed)")
            try:
                raw = path.read_bytes()
            except OSError as e:  # gone between the check and the read, or unreadable: the engine's side failed
                raise EngineUnavailable(f"{path}: could not be read ({type(e).__name__}: {e})") from None
        finally:
            if fd is not None:
                os.close(fd)
        try:
            return load(raw)
        except Exception as e:  # noqa: BLE001 - a torn file (writer killed mid-write): the engine failed
            raise EngineUnavailable(f"{path}: unreadable ({type(e).__name__}: {e}); the server's write was cut "
                                    "short") from None


def read_and_remove(path: Path | str, timeout: float, wait=lambda s: time.sleep(min(s, 0.05))) -> dict:
    """`read_when_ready`, then the staging file and its lock are deleted (also when reading failed)."""
    try:
        return read_when_ready(path, timeout, wait)
    finally:
        remove_staged(path)


class VllmBackend:
    name = "vllm"

    def __init__(self, settings: VllmSettings, final_norm: FinalNorm | None):
        self.s = settings
        self.capacity = max(1, settings.inflight)
        self.layer_ids = engine_layer_ids(settings.aux_layers, settings.num_layers)
        self.aux_slots = [self.layer_ids.index(i) for i in settings.aux_layers]
        self.final_slot = self.layer_ids.index(settings.num_layers)
        if settings.final_state == "post_norm" and final_norm is None:
            raise ValueError("post_norm needs the model's final norm")
        self.norm = final_norm
        self.staging = Path(settings.staging)
        self.wake = _Wakeup(self.staging)
        self.pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="hsbuild-vllm")
        self.results: queue.Queue[Outcome] = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._closed = False
        self._up = threading.Event()  # the server answered last time; cleared by a failure, set by /health
        self._up.set()

    # -- Backend --------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._lock:
            self._in_flight += 1
        self.pool.submit(self._run, request)

    def collect(self, timeout: float) -> list[Outcome]:
        out: list[Outcome] = []
        try:
            out.append(self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait())
            while True:
                out.append(self.results.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            self._in_flight -= len(out)
        return out

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def abandon_waiting(self) -> None:
        """The run is stopping: requests waiting for the server to come back give up (`Unavailable`)."""
        self._closed = True
        self._up.set()

    def close(self) -> None:
        self.abandon_waiting()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.wake.stop()

    # -- one request ----------------------------------------------------------------------------------
    def _run(self, r: Request) -> None:
        try:
            self.results.put(self._one(r))
        except Exception as e:  # noqa: BLE001 - a thread must always answer
            self.results.put(Failure(r.key, "error", f"{type(e).__name__}: {e}"))

    def _wait_until_up(self) -> bool:
        """After a failure, requests wait for /health instead of failing one after another while the server is
        down (the samples in flight when it died went back to pending; these wait). False: stopping."""
        while not self._up.is_set():
            if healthy(self.s.server):
                self._up.set()
            else:
                self._up.wait(1.0)
        return not self._closed

    def _one(self, r: Request) -> Outcome:
        ids = [int(x) for x in np.asarray(r.input_ids).tolist()]
        if not self._wait_until_up():
            return Unavailable(r.key, "the run is stopping while the server is unavailable")
        try:
            doc = complete(self.s.server, self.s.model_name, ids, self.s.request_timeout)
        except EngineUnavailable as e:
            self._up.clear()
            return Unavailable(r.key, str(e))
        except EngineRejected as e:
            return Failure(r.key, "rejected", str(e))
        params = doc.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            return Failure(r.key, "bad_states", "the server's answer names no hidden_states_path: is it running "
                           "with the extract_hidden_states method and the hidden-states connector? "
                           "(`hsbuild serve-command BUILD`)")
        path = Path(path)
        try:
            data = read_and_remove(path, self.s.file_timeout, self.wake.wait)
        except EngineUnavailable as e:
            self._up.clear()
            return Unavailable(r.key, str(e))
        return self._validate(r, ids, data)

    def _validate(self, r: Request, ids: list[int], data: dict[str, torch.Tensor]) -> Outcome:
        hs, tok = data.get("hidden_states"), data.get("token_ids")
        if hs is None or tok is None:
            return Failure(r.key, "bad_states", f"the staging file holds {sorted(data)}, not token_ids and "
                           "hidden_states")
        if tok.tolist() != ids:
            return Failure(r.key, "token_mismatch", f"the server's token ids ({tok.numel()}) differ from the "
                           f"request's ({len(ids)}) from position {_first_diff(tok.tolist(), ids)}")
        want = (len(ids), len(self.layer_ids), self.s.hidden_size)
        if tuple(hs.shape) != want:
            return Failure(r.key, "bad_states", f"hidden_states has shape {tuple(hs.shape)}, expected {want} "
                           f"(tokens, layer ids {self.layer_ids}, hidden): the server runs other layers or "
                           "another model")
        if DTYPE_NAMES.get(hs.dtype) != self.s.dtype:
            return Failure(r.key, "bad_states", f"hidden_states are {hs.dtype}, the build stores {self.s.dtype}: "
                           "serve the model with --dtype " + self.s.dtype)
        aux = torch.cat([hs[:, i, :] for i in self.aux_slots], dim=-1)
        final = hs[:, self.final_slot, :].contiguous()
        if self.s.final_state == "post_norm":
            assert self.norm is not None
            final = self.norm.apply(final)
        bad = check_finite(r.key, aux, final)
        return bad if bad is not None else States(r.key, aux.contiguous(), final)


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
