"""The vLLM backend's request path: forward passes in a running vLLM server, states ingested from its staging folder.

Upstream protocol, no engine patch: the server runs the speculative method `extract_hidden_states` with
`eagle_aux_hidden_state_layer_ids` = the build's engine layer ids and the KV connector
`ExampleHiddenStatesConnector` writing to the staging folder (`hsbuild serve-command BUILD` prints the
command). Each sample is one `POST /v1/completions` (prompt = its token ids, max_tokens 1); the answer names
`kv_transfer_params.hidden_states_path`, a `{request_id}.safetensors` file (`token_ids` int64 [T],
`hidden_states` [T, n_ids, H], slots in ascending id order) next to a `.lock` the server holds (flock) until the
file is complete.

Staging per build: each build stages into its own subfolder of the server's staging folder (`settings.staging`
is that subfolder): every request names its file there (`kv_transfer_params.hidden_states_path`; hsbuild's
connector, builder/extract/backends/vllm/connector.py, confines such paths to one subfolder of its folder), and a
run clears only its own subfolder, so builds sharing a server or a staging folder never touch each other's files.

Ingestion: a watchdog observer on the staging folder wakes the requests waiting for their file; a file is
ready when its lock can be taken shared (a file without its lock is never read: nothing says it is complete). It is read, validated (token ids equal the request's, shape, dtype,
finite), its final slot put in the build's convention, and deleted with its lock at once: the states live in
the worker's group until they are durable, so at most `capacity` staging files exist and none outlives a
crash as something a later run would trust (each run clears what earlier ones left). The staging folder's files
and its room: builder/extract/backends/staging.py; the least a file takes: states.py.

A staging volume that fills up pauses the run until it has room again (`staging_full`); one smaller than a
sample's file even when empty can never hold it: that request is answered `too_small`, and the run stops.

Regeneration (`init --regenerate`: a request with `generate`): the same request generates the response and stages
the states of the prompt and of the generated tokens, in one pass (generate.py).

Layer ids: states.py.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.extract.backends.base import (
    Failure,
    Generation,
    Outcome,
    Request,
    States,
    Unavailable,
    check_finite,
)
from builder.extract.backends.http_client import (
    EngineRejected,
    EngineUnavailable,
    ServerRefused,
    complete,
    completion,
    healthy,
)
from builder.extract.backends.staging import (
    STAGING_SUFFIX,
    never_fits,
    read_and_remove,
    remove_staged,
    volume_capacity,
    volume_room,
)
from builder.extract.backends.vllm.generate import (
    BadAnswer,
    Response,
    first_diff,
    generation_problem,
    read_response,
    request_body,
)
from builder.extract.backends.vllm.states import engine_layer_ids, staged_file_bytes

if TYPE_CHECKING:  # (torch: imported once a worker opens the backend)
    import torch

    from builder.formats.final_state import FinalNorm

# the longest wait between two checks of a server that is still away (the waits double from 0.5 s up to this): how
# late, at most, a run notices that its server is back
RETRY_MAX_S = max(0.5, float(os.environ.get("HSBUILD_SERVER_RETRY_MAX", "30")))
# room allowed beside a staging file's tensors when staging fills up (its header, the filesystem's blocks, the files
# of other requests written meanwhile): a volume with less free than twice (file + this) is full
FILE_SLACK = 1 << 20


@dataclass(frozen=True)
class VllmSettings:
    server: str
    model_name: str  # the id the server serves the model under (its /v1/models)
    staging: str  # the build's own subfolder of the server's staging folder
    aux_layers: list[int]
    num_layers: int
    hidden_size: int
    dtype: str  # bfloat16, float16, float32: what the server must return
    final_state: str  # post_norm | pre_norm: what the build stores as hidden_state
    inflight: int = 16
    request_timeout: float = 600.0  # one prefill of the longest sample, queued behind `inflight` others
    token_timeout: float = 1.0  # a generation's request waits this much longer per token it may generate
    file_timeout: float = 120.0  # from the answer to a complete staging file
    health_every: float = 2.0  # /health is asked this often: a server that went away is checked again on return


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


class VllmBackend:
    name = "vllm"

    def __init__(self, settings: VllmSettings, final_norm: FinalNorm | None,
                 recheck: Callable[[], object] | None = None):
        """`recheck`: run before requests go out again after the server was away (a failed request, a /health
        that did not answer): raises ServerRefused when the server that came back is not the build's (another
        model, other layers), EngineUnavailable when it is gone again. None: no check (tests of the transport)."""
        self.s = settings
        self.capacity = max(1, settings.inflight)
        self.layer_ids = engine_layer_ids(settings.aux_layers, settings.num_layers)
        self.aux_slots = [self.layer_ids.index(i) for i in settings.aux_layers]
        self.final_slot = self.layer_ids.index(settings.num_layers)
        if settings.final_state == "post_norm" and final_norm is None:
            raise ValueError("post_norm needs the model's final norm")
        self.norm = final_norm
        self.recheck = recheck
        self.staging = Path(settings.staging)
        self.staging.mkdir(exist_ok=True)
        self.wake = _Wakeup(self.staging)
        self.pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="hsbuild-vllm")
        self.results: queue.Queue[Outcome] = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._closed = False
        self._refused: str | None = None  # the server is not the build's: every request gives up with this
        self._up = threading.Event()  # the server answered last time; cleared by a failure, set by the check
        self._up.set()
        self._check_lock = threading.Lock()  # one thread checks the server that came back; the others wait
        self._retry_in = 0.0  # backoff between checks of a server that is still not back (0.5 s doubling)
        self._need_bytes = 0  # free bytes staging must have again after it filled up
        self._watching = True
        threading.Thread(target=self._health_watch, name="hsbuild-vllm-health", daemon=True).start()

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
        self._watching = False
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.wake.stop()

    # -- the server going away and coming back ---------------------------------------------------------
    def _health_watch(self) -> None:
        """A server that went away between two requests (restarted, perhaps with another model) is checked
        again before the next one: a restart takes far longer than this period (the model loads)."""
        while self._watching:
            time.sleep(self.s.health_every)
            if self._up.is_set() and not self._closed and not healthy(self.s.server, timeout=10.0):
                self._up.clear()

    def _room(self) -> bool:
        """Staging has room again after it filled up (at least the bytes of the write that failed, twice)."""
        if not self._need_bytes:
            return True
        try:
            free, _ = volume_room(self.staging)
        except OSError:
            return True
        if free >= self._need_bytes:
            self._need_bytes = 0
            return True
        return False

    def _wait_until_up(self) -> str | None:
        """After a failure, requests wait instead of failing one after another: until /health answers, staging
        has room, and the server that is back has been checked (`recheck`) to be the build's. Retries back off
        (0.5 s, doubling, at most RETRY_MAX_S). Returns None to go on, else why to give up (stopping, or refused)."""
        while True:
            if self._refused is not None:
                return self._refused
            if self._closed:
                return "the run is stopping while the server is unavailable"
            if self._up.is_set():
                return None
            with self._check_lock:
                if self._up.is_set() or self._refused is not None or self._closed:
                    continue
                if self._retry_in:
                    self._up.wait(self._retry_in)  # (set by abandon_waiting: stop waiting)
                    if self._closed:
                        continue
                if healthy(self.s.server) and self._room():
                    try:
                        if self.recheck is not None:
                            self.recheck()
                        self._retry_in = 0.0
                        self._up.set()
                        continue
                    except ServerRefused as e:
                        self._refused = str(e)
                        continue
                    except EngineUnavailable:
                        pass
                self._retry_in = min(RETRY_MAX_S, max(0.5, self._retry_in * 2))

    def _unavailable(self, r: Request, message: str) -> Unavailable:
        self._up.clear()
        return Unavailable(r.key, message)

    # -- one request ----------------------------------------------------------------------------------
    def _run(self, r: Request) -> None:
        try:
            self.results.put(self._one(r))
        except Exception as e:  # noqa: BLE001 - a thread must always answer
            self.results.put(Failure(r.key, "error", f"{type(e).__name__}: {e}"))

    def _one(self, r: Request) -> Outcome:
        import numpy as np  # noqa: PLC0415

        ids = [int(x) for x in np.asarray(r.input_ids).tolist()]
        why = self._wait_until_up()
        if why is not None:
            return Unavailable(r.key, why, refused=self._refused is not None)
        gen = r.generate
        problem = None if gen is None else generation_problem({"temperature": gen.temperature})
        if problem is not None:  # (init refuses such a build: nothing of it may be stored)
            self._refused = problem
            return Unavailable(r.key, problem, refused=True)
        path = self.staging / f"{uuid.uuid4().hex}{STAGING_SUFFIX}"
        try:
            if gen is None:
                doc = complete(self.s.server, self.s.model_name, ids, self.s.request_timeout,
                               {"hidden_states_path": str(path)})
            else:
                doc = completion(self.s.server, request_body(self.s.model_name, ids, gen, str(path)),
                                 self.s.request_timeout + gen.max_new_tokens * self.s.token_timeout)
        except EngineUnavailable as e:
            remove_staged(path)
            return self._unavailable(r, str(e))
        except EngineRejected as e:
            remove_staged(path)
            return Failure(r.key, "rejected", str(e))
        params = doc.get("kv_transfer_params") or {}
        answered = params.get("hidden_states_path")
        if gen is not None and not gen.capture:
            return self._tokens_only(r, ids, gen, doc, answered)
        if not answered:
            self._refused = ("the server's answer names no hidden_states_path: it does not run the "
                             "extract_hidden_states method with the hidden-states connector; start it with the command "
                             "`hsbuild serve-command BUILD` prints")
            return Unavailable(r.key, self._refused, refused=True)
        if Path(answered) != path:
            remove_staged(answered)
            self._refused = (f"the server wrote its states to {answered}, not to the file the request named in the "
                             f"build's staging folder {self.staging}: its connector does not stage per build; "
                             "start it with the command `hsbuild serve-command BUILD` prints")
            return Unavailable(r.key, self._refused, refused=True)
        try:
            response = None if gen is None else read_response(doc, ids, gen)
        except BadAnswer as e:
            return self._bad_answer(r, e, path)
        try:
            data = read_and_remove(path, self.s.file_timeout, self.wake.wait)
        except EngineUnavailable as e:
            full = self._staging_full(len(ids))
            if full is not None:
                message, never = full
                self._up.clear()
                return Unavailable(r.key, message, need_bytes=self._need_bytes, too_small=never)
            return self._unavailable(r, str(e))
        return self._validate(r, ids, data) if response is None else self._with_response(r, ids, response, data)

    def _with_response(self, r: Request, ids: list[int], response: Response, data: dict[str, torch.Tensor]) -> Outcome:
        """A generation's outcome: its staged file must hold the prompt and the stored part of the response."""
        import numpy as np  # noqa: PLC0415

        out = self._validate(r, response.staged_ids(ids), data)
        if isinstance(out, Failure):
            return out
        return dataclasses.replace(out, output_ids=np.asarray(response.output_ids, dtype=np.int64),
                                   finish_reason=response.finish_reason, stored_output=response.stored_output)

    def _tokens_only(self, r: Request, ids: list[int], gen: Generation, doc: dict, staged: str | None) -> Outcome:
        """A generation whose states are not needed (an earlier turn of --turns all): its tokens, and empty states.
        A file staged all the same (a connector that does not know SKIP_STATES) is removed once written."""
        if staged:
            try:
                read_and_remove(staged, self.s.file_timeout, self.wake.wait)
            except EngineUnavailable:
                pass  # (removed: nothing of it is used)
        try:
            response = read_response(doc, ids, gen)
        except BadAnswer as e:
            return self._bad_answer(r, e, None)
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        from builder.store.dtypes import torch_dtype  # noqa: PLC0415

        dtype = torch_dtype(self.s.dtype)
        return States(r.key, torch.empty(0, len(self.aux_slots) * self.s.hidden_size, dtype=dtype),
                      torch.empty(0, self.s.hidden_size, dtype=dtype),
                      output_ids=np.asarray(response.output_ids, dtype=np.int64),
                      finish_reason=response.finish_reason, stored_output=0)

    def _bad_answer(self, r: Request, e: BadAnswer, staged: Path | None) -> Outcome:
        """An answer that cannot be the request's response: its staged file removed (once written), the sample
        failed, or the run stopped when no answer of this server can be (`e.server`)."""
        if staged is not None:
            try:
                read_and_remove(staged, self.s.file_timeout, self.wake.wait)
            except EngineUnavailable:
                pass
        if e.server:
            self._refused = str(e)
            return Unavailable(r.key, self._refused, refused=True)
        return Failure(r.key, e.reason, str(e))

    def _staging_full(self, tokens: int) -> tuple[str, bool] | None:
        """When the staging volume has no room for a file of `tokens` tokens (the server's write failed with ENOSPC,
        which only its own log shows): the message that names it, and whether the file can never fit there (the
        volume is smaller than the file even when empty: the run must stop). Else requests wait until the volume
        has room for the file twice over (with FILE_SLACK each), or, on a volume too small for that, as much room
        as it can have (nearly all of it). None: the volume has room (the write failed for another reason)."""
        least = staged_file_bytes(tokens, len(self.layer_ids), self.s.hidden_size, self.s.dtype)
        try:
            free, total = volume_room(self.staging)
            capacity = volume_capacity(self.staging)
        except OSError:
            return None
        never = never_fits(self.staging, tokens, least)
        if never is not None:
            return never, True
        room = max(least, min(2 * (least + FILE_SLACK), capacity * 31 // 32))  # (what an empty volume has, nearly)
        if free >= room:
            return None
        self._need_bytes = max(self._need_bytes, room)
        used = 1 - free / total if total else 1.0
        return (f"the staging volume is full (ENOSPC): the server could not write a {tokens}-token file into "
                f"{self.staging}, whose volume has {free} bytes free of {total} ({used:.1%} used); requests wait "
                "until it has room (free space there, or give staging a bigger volume)"), False

    def _validate(self, r: Request, ids: list[int], data: dict[str, torch.Tensor]) -> Outcome:
        hs, tok = data.get("hidden_states"), data.get("token_ids")
        if hs is None or tok is None:
            return Failure(r.key, "bad_states", f"the staging file holds {sorted(data)}, not token_ids and "
                           "hidden_states")
        if tok.tolist() != ids:
            return Failure(r.key, "token_mismatch", f"the server's token ids ({tok.numel()}) differ from the "
                           f"request's ({len(ids)}) from position {first_diff(tok.tolist(), ids)}")
        want = (len(ids), len(self.layer_ids), self.s.hidden_size)
        if tuple(hs.shape) != want:
            return Failure(r.key, "bad_states", f"hidden_states has shape {tuple(hs.shape)}, expected {want} "
                           f"(tokens, layer ids {self.layer_ids}, hidden): the server runs other layers or "
                           "another model")
        from builder.store.dtypes import torch_dtype  # noqa: PLC0415 - (numpy, torch: not at import)

        if hs.dtype != torch_dtype(self.s.dtype):
            return Failure(r.key, "bad_states", f"hidden_states are {hs.dtype}, the build stores {self.s.dtype}: "
                           "serve the model with --dtype " + self.s.dtype)
        import torch  # noqa: PLC0415

        aux = torch.cat([hs[:, i, :] for i in self.aux_slots], dim=-1)
        final = hs[:, self.final_slot, :].contiguous()
        if self.s.final_state == "post_norm":
            assert self.norm is not None
            final = self.norm.apply(final)
        bad = check_finite(r.key, aux, final)
        return bad if bad is not None else States(r.key, aux.contiguous(), final)
