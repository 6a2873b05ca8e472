"""hsbuild's KV connectors for vLLM's `extract_hidden_states` method: loaded by the server, not by hsbuild
(`kv_connector_module_path` = this module, in the command `hsbuild serve-command BUILD` prints; servers started
with an older command line name its old path, builder/extract/backends/vllm_connector.py, an alias of this one).

Both keep vLLM's `ExampleHiddenStatesConnector` as it is (file format, lock files, the writer pool) and add one
rule: a request may name where its file goes (`kv_transfer_params.hidden_states_path`, which the stock
connector honours only with `allow_custom_save_path`, anywhere on the server's filesystem), but only inside
the server's own staging folder, one build subfolder deep (`STAGING/<build id>/<file>.safetensors`). Any
other path falls back to the stock default (`STAGING/<request id>.safetensors`), which hsbuild refuses to read
(it is not its build's). So one server can serve several builds of the same model and layers, each staging
into its own subfolder, and no client can make the server write anywhere else. A request whose
`kv_transfer_params` say `SKIP_STATES` (builder/extract/backends/vllm/states.py: an earlier turn of a
regeneration, whose tokens alone are needed) is staged nowhere: no file, no lock.

- `HsbuildHiddenStatesConnector`: servers on GPUs (the stock device-to-host copy on a CUDA stream).
- `CpuHiddenStatesConnector`: vLLM's CPU build. The stock connector copies rows into pinned memory on a CUDA
  stream (`pin_memory=True requires a CUDA or other accelerator backend` on a CPU-only torch); on the CPU the KV
  cache already is host memory, so the rows are gathered synchronously.

This module imports vLLM: only the server imports it.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from builder.extract.backends.vllm.states import SKIP_STATES


def confined(path: str, storage: str) -> bool:
    """`path` is a file directly inside a subfolder of `storage` (no `..`, no symlinked escape of the folder
    named: its parent is resolved as it is when the check runs)."""
    root = os.path.realpath(storage)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    name = os.path.basename(path)
    return (os.path.dirname(parent) == root and name.endswith(".safetensors") and "/" not in name
            and name not in (".", ".."))


class HsbuildHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock connector, with per-request paths confined to one subfolder of the staging folder."""

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201 - vLLM's signature
        self.allow_custom_save_path = True  # (confined below: the stock check alone allows any path)
        meta = super().build_connector_meta(scheduler_output)
        for req_id, filename in list(meta.new_req_filenames.items()):
            if not confined(filename, self._storage_path):
                default = os.path.join(self._storage_path, f"{req_id}.safetensors")
                meta.new_req_filenames[req_id] = default
                self._request_filenames[req_id] = default
        for new_req in scheduler_output.scheduled_new_reqs:
            if _kv_params(new_req).get(SKIP_STATES):  # (no file name: request_finished stages nothing)
                meta.new_req_filenames.pop(new_req.req_id, None)
                self._request_filenames.pop(new_req.req_id, None)
        return meta


def _kv_params(new_req) -> dict:  # noqa: ANN001 - vLLM's NewRequestData
    """A newly scheduled request's kv_transfer_params (where vLLM's stock connector reads them)."""
    extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
    return (extra or {}).get("kv_transfer_params") or {}


class _Done:
    """Stands in for the CUDA event the stock connector polls: the copy is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(HsbuildHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:  # noqa: ANN001 - vLLM's PendingSave
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        hs = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hs, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
