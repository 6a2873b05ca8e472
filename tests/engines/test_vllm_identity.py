"""Issue 28, the engine edge, against real vLLM servers (CPU build): a build never holds another model's or other
layers' states, whatever server it is pointed at, on its first run or after the server came back.

- A server serving other layers of the same width, or another model of the same shape, is refused on a build's
  FIRST run: exit 4, one line naming both, nothing started or written.
- A server whose configuration cannot be read (here: behind a TCP proxy, so the process listening on the port is
  no vLLM server) is refused unless `--trust-server`, which the run's events record and `status` shows.
- Two builds share one server and one staging folder: each stages into its own subfolder, neither deletes the
  other's files, every sample is written once.
- A server started from the line `hsbuild serve-command` prints, run as printed by a shell, with its staging
  folder on a small real tmpfs: a full staging volume pauses the run naming ENOSPC and that volume (not the
  build's), with no failure counted and no busy loop, and the run finishes once the volume has room; then the API
  server is killed with -9 mid-run: `doctor` names the engine processes it left behind with a kill command that
  ends them, and a server of ANOTHER model restarted under the same address and name is refused (exit 4); every
  sample written before holds the build's model's states.
- Connect mode, the server someone else runs killed with -9 mid-run (its whole process group): the run pauses,
  not fails, and finishes once a server is back on the same address. The tests of this section share one server
  address, in file order (one vLLM start each saved: they take most of the time): the connect test restarts the
  printed server it killed, and the kill -9 test after it crashes that one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import forked
import pytest
import torch
from conftest import hsbuild, mounted_tmpfs, random_rows, set_config, write_jsonl, written_count
from test_vllm import _check_against_transformers, _one_written_each
from test_vllm_launch import _why
from vllm_fixture import (
    VOCAB,
    Server,
    _die_with_parent,
    free_port,
    hsbuild_cmd,
    needs_vllm,
    start_server,
    stop_server,
    wait_healthy,
)

from builder.config import Watermarks
from builder.doctor.procinfo import scan_processes
from builder.extract.backends.http_client import healthy, served_model
from builder.extract.backends.staging import staging_name
from builder.layout import layout
from builder.log.events import EventLog
from builder.procfs import listening_pids
from builder.run.create import init_build

pytestmark = [pytest.mark.slow, needs_vllm]

# a short context (no compilation warm-up on CPUs: serve-command's own default, -O0)
ENGINE_ARGS = ["--max-model-len", "2048"]


def _init(tmp_path: Path, name: str, n: int, model: Path, server: str, staging: Path, seed: int = 0, **kw) -> Path:
    src = write_jsonl(tmp_path / f"{name}.jsonl", random_rows(n, seed, vocab=VOCAB, hi=kw.pop("hi", 120)))
    return init_build(tmp_path / name, src, model=str(model), backend="vllm", server=server, staging=str(staging),
                      **kw).root


def _own_staging(build: Path, staging: Path) -> Path:
    """The build's own subfolder of the staging folder."""
    with EventLog(layout(build).events, read_only=True) as log:
        return staging / staging_name(log.meta())


def _events(build: Path, sql: str) -> list[tuple]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query(sql)[1]


def _count(build: Path, kind: str) -> int:
    return _events(build, f"SELECT count(*) FROM events WHERE kind = '{kind}'")[0][0]


def _refused_line(cp: subprocess.CompletedProcess) -> str:
    assert cp.returncode == 4, (cp.returncode, cp.stdout, cp.stderr)
    lines = [ln for ln in cp.stderr.splitlines() if "refused" in ln.lower() or "error" in ln.lower()]
    assert lines and "Traceback" not in cp.stderr, cp.stderr
    return lines[-1]


def _other_model(path: Path, like: Path) -> Path:
    """A model of the same shape and tokenizer as `like`, with other weights."""
    import transformers

    torch.manual_seed(123)
    transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(str(like))).save_pretrained(path)
    for f in like.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory, tiny_llama) -> Path:
    return _other_model(tmp_path_factory.mktemp("other") / "model", tiny_llama)


# -- the first run is checked ---------------------------------------------------------------------------------

def test_a_server_for_other_layers_of_the_same_width_is_refused_on_the_first_run(tmp_path, vllm_server):
    """The server returns ids [1, 2, 3, 4]; the build asks for aux layers 0, 1, 3 (ids [0, 1, 3, 4]): the same
    four slots of the same width, so the probe's shapes alone would pass. Refused before any sample is sent."""
    build = _init(tmp_path, "b", 6, vllm_server.model, vllm_server.url, vllm_server.staging, aux_layers=[0, 1, 3])
    cp = hsbuild("run", build, "--no-progress", timeout=600)
    line = _refused_line(cp)
    assert "serves layer ids [1, 2, 3, 4], the build's are [0, 1, 3, 4]" in line, line
    assert "serve-command" in line
    assert (_count(build, "started"), _count(build, "written"), _count(build, "failed")) == (0, 0, 0)
    assert _count(build, "engine_refused") == 1


def test_a_server_of_another_model_is_refused_on_the_first_run(tmp_path, vllm_server, other_llama):
    """The build is of another model of the same shape (same layers, hidden size, vocabulary): refused."""
    build = _init(tmp_path, "b", 6, other_llama, vllm_server.url, vllm_server.staging)
    cp = hsbuild("run", build, "--no-progress", timeout=600)
    line = _refused_line(cp)
    assert f"serves the model {vllm_server.model}, the build's is {other_llama}" in line, line
    assert (_count(build, "started"), _count(build, "written")) == (0, 0)


# -- a server hsbuild cannot see into ---------------------------------------------------------------------------

class Forwarder:
    """A TCP proxy on 127.0.0.1 in front of the server: the process listening on its port is this test's."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_a_server_behind_a_proxy_is_refused_unless_trusted(tmp_path, vllm_server):
    proxy = Forwarder(int(vllm_server.url.rsplit(":", 1)[1]))
    try:
        build = _init(tmp_path, "b", 12, vllm_server.model, proxy.url, vllm_server.staging, seed=4)
        cp = hsbuild("run", build, "--no-progress", timeout=600)
        line = _refused_line(cp)
        assert "cannot tell which model and layers it serves" in line and "--trust-server" in line, line
        assert f"pid {os.getpid()}" in line  # the process listening on the proxy's port: this one
        assert _count(build, "started") == 0

        cp = hsbuild("run", build, "--no-progress", "--trust-server", timeout=600)
        assert cp.returncode == 0, cp.stderr
        assert "--trust-server" in cp.stderr
        probes = [json.loads(d) for (d,) in _events(build, "SELECT detail FROM events WHERE kind = 'engine_probe'")]
        assert probes and probes[0]["trust_server"] and "not a vLLM server" in probes[0]["trusted"], probes
        st = json.loads(hsbuild("status", build, "--json").stdout)
        assert "not a vLLM server" in st["trust_server"], st
        assert "took --trust-server" in hsbuild("status", build).stdout
    finally:
        proxy.close()
    _one_written_each(build, 12)
    assert _check_against_transformers(build, vllm_server.model, "pre_norm") == 12


# -- one staging folder, several builds -------------------------------------------------------------------------

def test_two_builds_share_one_server_and_staging_folder(tmp_path, vllm_server, hold):
    """Both run at once through the same server into the same staging folder; another build's files in its
    subfolder (a sentinel) and files beside the subfolders are never touched. (Both runs are held by the test
    hook at their 3rd task until both are there: they certainly overlap, whatever their size.)"""
    other = vllm_server.staging / "build-someone-else"
    other.mkdir(exist_ok=True)
    sentinel = other / "x.safetensors"
    sentinel.write_bytes(b"not ours")
    (other / "x.safetensors.lock").write_bytes(b"")
    n = 30
    builds = [_init(tmp_path, f"b{i}", n, vllm_server.model, vllm_server.url, vllm_server.staging, seed=20 + i,
                    inflight=4) for i in range(2)]
    holds = [hold(3), hold(3)]
    runs = [forked.Popen(hsbuild_cmd("run", b, "--no-progress"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=h.env) for b, h in zip(builds, holds, strict=True)]
    try:
        for h, r in zip(holds, runs, strict=True):
            h.wait(1, r)
        for h in holds:
            h.release()
        outs = [r.communicate(timeout=900) for r in runs]
        for r, (_, err) in zip(runs, outs, strict=True):
            assert r.returncode == 0, err
        for b in builds:
            _one_written_each(b, n)
        assert sentinel.read_bytes() == b"not ours" and (other / "x.safetensors.lock").exists()
        left = sorted(p.relative_to(vllm_server.staging) for p in vllm_server.staging.rglob("*") if p.is_file())
        assert left == [Path("build-someone-else/x.safetensors"), Path("build-someone-else/x.safetensors.lock")], left
        # each run removed its own subfolder at its end (it made it), and nothing else
        assert [b for b in builds if _own_staging(b, vllm_server.staging).exists()] == [], os.listdir(vllm_server.staging)
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
        shutil.rmtree(other, ignore_errors=True)  # (the session's server serves the other tests too)


# -- the printed command, a full staging volume, a crash, another model ------------------------------------------

@dataclass
class Printed:
    root: Path
    build: Path  # the build whose serve-command started the server
    started: list[Server]  # every server started at the address, in order; all stopped at the end

    @property
    def server(self) -> Server:
        """The server now at the address: the printed one, until the connect test brings another back."""
        return self.started[-1]


@pytest.fixture(scope="module")
def printed(tmp_path_factory, tiny_llama) -> Printed:
    """A build whose server runs the line `hsbuild serve-command BUILD` prints, run by bash as printed, with the
    staging folder on a 24 MB tmpfs (mounted here; skipped where it cannot be)."""
    root = tmp_path_factory.mktemp("printed")
    with mounted_tmpfs(root / "stg", "24m") as staging:
        url = f"http://127.0.0.1:{free_port()}"
        # watermarks out of the way (a nearly full staging volume would pause the run before a write fails:
        # tests/space/test_storage.py), so that the server's write meets ENOSPC
        build = _init(root, "a", 40, tiny_llama, url, staging, seed=31,
                      watermarks=Watermarks(low=0.9998, high=0.9999, flood=0.99995))
        set_config(build, engine_args=list(ENGINE_ARGS))  # as a user would: engine_args in hsbuild.toml
        cp = hsbuild("serve-command", build)
        assert cp.returncode == 0, cp.stderr
        line = cp.stdout.strip()
        assert "\n" not in line and "VLLM_HOST_IP=127.0.0.1" in line and "--kv-cache-memory-bytes" in line, line
        assert "builder.extract.backends.vllm.connector" in line and "PYTHONPATH" not in line, line
        assert " -O0 " in line, line  # on CPUs: no torch.compile warm-up at the server's start, unasked
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH"))}
        log = root / "server.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=root, preexec_fn=_die_with_parent)
        wait_healthy(url, proc, log, 900, "the printed command did not serve")
        shared = Printed(root, build, [Server(url, tiny_llama, staging, proc, log)])
        try:
            yield shared
        finally:
            for server in shared.started:
                stop_server(server.proc)
                _kill_engines_of(server.proc.pid)


def _kill_engines_of(pgid: int) -> None:
    for p in scan_processes().values():
        if p.pgid == pgid:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _status(build: Path) -> dict:
    cp = forked.run(hsbuild_cmd("status", build, "--json"), capture_output=True, text=True)
    return json.loads(cp.stdout) if cp.returncode == 0 else {}


def _wait_for(pred, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_full_staging_volume_pauses_the_run_naming_enospc_then_it_finishes(printed):
    root, build, server = printed.root, printed.build, printed.server
    staging = server.staging
    free = shutil.disk_usage(staging).free
    filler = staging / "filler.bin"  # someone else's file on the staging volume: it leaves ~40 KB free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - 40_000))
    err_path = root / "run-a.err"
    with open(err_path, "w") as err:
        run = forked.Popen(hsbuild_cmd("run", build, "--no-progress", "--inflight", "4"), stdout=subprocess.PIPE,
                           stderr=err, text=True)
    try:
        _wait_for(lambda: "ENOSPC" in err_path.read_text() or run.poll() is not None, 300, "the run to name ENOSPC")
        assert run.poll() is None, err_path.read_text()
        text = err_path.read_text()
        assert str(staging) in text and "PAUSED" in text, text
        st = _wait_for(lambda: (s := _status(build)) and s.get("paused") and s, 30, "a paused status")
        assert st["pause_reason"] == "staging_full", st
        before = _count_live(build)
        time.sleep(15)
        after = _count_live(build)
        assert after - before <= 4, f"{after - before} server_unavailable failures in 15 s while paused: a busy loop"
        os.unlink(filler)  # room again
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
        filler.unlink(missing_ok=True)
    text = err_path.read_text()
    assert run.returncode == 0, text
    _one_written_each(build, 40)
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.query("SELECT count(*) FROM samples WHERE attempts > 1")[1][0][0] == 0  # nothing counted
        paused = log.query("SELECT reason FROM events WHERE kind = 'paused'")[1]
    assert ("staging_full",) in paused, paused
    assert not [p for p in staging.rglob("*") if p.is_file()], "staging files or locks left behind"
    assert _check_against_transformers(build, server.model, "pre_norm") == 40


@contextlib.contextmanager
def _resized(mnt: Path, size: str, back: str):
    """The tmpfs at `mnt` remounted to `size` (its files kept), and back to `back` after."""
    r = subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    try:
        yield mnt
    finally:
        subprocess.run(["mount", "-o", f"remount,size={back}", str(mnt)], capture_output=True, check=True)


def test_a_staging_volume_smaller_than_one_samples_file_stops_the_run_in_one_line(printed):
    """The server's staging volume (its real tmpfs) shrunk to 64 KiB: room for the probe's 16-token file, none for
    a file of these samples (150-300 tokens: 150 * 4 slots * 128 * 2 bytes alone is 150 KiB), even with the volume
    empty. The run does not pause for room that can never come: it stops in one line naming both sizes and
    `--staging`, exit 3, nothing failed for good, and leaves nothing in the staging folder. On a volume that holds
    a file, a rerun writes every sample (below)."""
    root, server = printed.root, printed.server
    assert healthy(server.url), "the module's server is down: a test before this one left it so"
    src = write_jsonl(root / "small.jsonl", random_rows(6, 51, vocab=VOCAB, lo=150, hi=300))
    build = init_build(root / "small", src, model=str(server.model), backend="vllm", server=server.url,
                       staging=str(server.staging), inflight=2,
                       watermarks=Watermarks(low=0.9998, high=0.9999, flood=0.99995)).root  # (as `printed`'s)
    with _resized(server.staging, "16k", "24m"):  # not even the probe's file (16 tokens, 16520 bytes): no sample sent
        cp = hsbuild("run", build, "--no-progress", timeout=600)
        assert cp.returncode == 3 and "Traceback" not in cp.stderr, (cp.returncode, cp.stderr)
        assert re.search(r"^hsbuild run: error: the staging folder .* on a volume of 16384 bytes .*, smaller than one "
                         r"16-token staging file \(at least 16520 bytes", cp.stderr, re.M), cp.stderr
        assert _count(build, "started") == 0 and not list(server.staging.iterdir())
    with _resized(server.staging, "64k", "24m"):
        cp = hsbuild("run", build, "--no-progress", timeout=600)
        assert cp.returncode == 3, (cp.returncode, cp.stdout, cp.stderr)
        assert "Traceback" not in cp.stderr and "PAUSED" not in cp.stderr, cp.stderr
        line = cp.stderr.strip().splitlines()[-1]
        assert line.startswith(f"hsbuild run: error: the staging folder {server.staging} is on a volume of "), cp.stderr
        capacity = shutil.disk_usage(server.staging).total
        assert f"a volume of {capacity} bytes" in line and "--staging" in line and "serve-command" in line, line
        need = int(re.search(r"at least (\d+) bytes", line).group(1))
        tokens = int(re.search(r"than one (\d+)-token staging file", line).group(1))
        assert need == 8 + tokens * 8 + tokens * 4 * 128 * 2 > capacity == 64 << 10, line
        with EventLog(layout(build).events, read_only=True) as log:
            # nothing written, nothing failed for good (what was tried went back to pending: server_unavailable)
            assert log.query("SELECT count(*) FROM samples WHERE state IN ('written', 'verified') OR (state = "
                             "'failed' AND error <> 'server_unavailable')")[1][0][0] == 0
            assert log.query("SELECT reason FROM events WHERE kind = 'run_finished' ORDER BY seq DESC LIMIT 1")[1] == [
                ("staging_too_small",)]
        assert not list(server.staging.iterdir()), list(server.staging.iterdir())  # nothing left behind
    # 2 MiB holds these files, not twice a file and 1 MiB to spare: filled by someone else's file (100 KB left), the
    # run pauses (staging_full); once that file is gone it goes on: it waits for as much room as the volume can
    # have (nearly all of it), not for more, and writes every sample
    with _resized(server.staging, "2m", "24m"):
        filler = server.staging / "filler.bin"
        filler.write_bytes(b"\0" * (shutil.disk_usage(server.staging).free - 100_000))
        err_path = root / "run-small.err"
        with open(err_path, "w") as err:
            run = forked.Popen(hsbuild_cmd("run", build, "--no-progress"), stdout=subprocess.PIPE, stderr=err,
                               text=True)
        try:
            _wait_for(lambda: "PAUSED (staging_full)" in err_path.read_text() or run.poll() is not None, 300,
                      "the run to pause for room")
            assert run.poll() is None, err_path.read_text()
            filler.unlink()
            run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
            filler.unlink(missing_ok=True)
    assert run.returncode == 0, err_path.read_text()
    assert "resumed: the staging volume has room again" in err_path.read_text()
    _one_written_each(build, 6)
    assert not list(server.staging.iterdir()), list(server.staging.iterdir())


def test_connect_mode_pauses_while_the_server_is_gone_and_finishes_when_it_is_back(printed, hold):
    """The server someone else runs is killed with -9 mid-run: the run pauses (not fails), waits, and finishes
    once a server is back on the same address; nothing lost, nothing duplicated. (The server is the module's: the
    one the printed command started; the one brought back stays for the next test.)"""
    first, root = printed.server, printed.root
    assert healthy(first.url), "the module's server is down: a test before this one left it so"
    staging, tiny_llama = first.staging, first.model
    # the worker is held before its 6th task (the test hook) while the server dies, then sends that sample to it
    n = 40
    src = write_jsonl(root / "conn.jsonl", random_rows(n, 8, vocab=VOCAB, hi=300))
    build = init_build(root / "conn", src, model=str(tiny_llama), backend="vllm", server=first.url,
                       staging=str(staging), inflight=4).root
    held = hold(6)
    run = forked.Popen(hsbuild_cmd("run", build, "--no-progress"), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=held.env)
    try:
        held.wait(1, run, timeout=600)
        os.killpg(first.proc.pid, signal.SIGKILL)  # the whole server, as a machine's crash would
        first.proc.wait()
        held.release()

        def met_it() -> dict | bool:  # the run met the dead server: paused, what it had in flight back to pending
            if run.poll() is not None:
                return True
            s = _status(build)
            return bool(s.get("paused") and s.get("requeued", 0) >= 1) and s

        st = _wait_for(met_it, 120, "the run to pause on the dead server")
        if run.poll() is not None:
            out, err = run.communicate()
            pytest.fail(f"the run ended (rc {run.returncode}) while the server was gone: {err[-2000:]}")
        assert st["paused"] and st["pause_reason"] == "server_unavailable" and st["server_healthy"] is False, st
        # the samples in flight when it died went back to pending (requeued), never counted as failed; no ETA
        assert st["failed"] == 0 and st["requeued"] >= 1 and st["eta_seconds"] is None, st
        text = forked.run(hsbuild_cmd("status", build), capture_output=True, text=True).stdout
        assert "engine:  vllm" in text and not re.search(r"ETA \d", text), text
        assert any(ln.startswith("PAUSED:") and "server_unavailable" in ln for ln in text.splitlines()), text
        # (more of what was in flight may fail while the server stays gone: the count only grows meanwhile)
        said = re.search(r"\((\d+) of the pending went back to pending", text)
        assert said and st["requeued"] <= int(said.group(1)) <= _status(build)["requeued"], text
        # bring a server back on the same address (the user restarting it)
        # (the server at the module's address from now on)
        printed.started.append(start_server(root, tiny_llama, staging, port=int(first.url.rsplit(":", 1)[1])))
        out, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, _why(build, out, err)
    assert "PAUSED (server_unavailable)" in err and "healthy again" in err
    _one_written_each(build, n)
    with EventLog(layout(build).events, read_only=True) as log:
        assert log.query("SELECT count(*) FROM samples WHERE state = 'failed'")[1][0][0] == 0
        unavailable = log.query("SELECT count(*) FROM events WHERE reason = 'server_unavailable' AND kind = 'failed'")
        rechecks = log.query("SELECT count(*) FROM events WHERE kind = 'engine_probe' AND "
                             "json_extract(detail, '$.recheck')::BOOLEAN")[1][0][0]
    assert unavailable[1][0][0] >= 1  # in flight when it died: back to pending, then written
    assert rechecks >= 1  # the server that came back was checked (command line, /v1/models, probe) first


def _count_live(build: Path) -> int:
    cp = forked.run(hsbuild_cmd("sql", build, "SELECT count(*) FROM events WHERE kind = 'failed'", "--csv"),
                    capture_output=True, text=True)
    last = cp.stdout.strip().splitlines()[-1:]
    return int(last[0]) if last and last[0].isdigit() else -1


def test_kill_9_of_the_api_server_then_another_model_on_the_same_address_is_refused(printed, other_llama, hold):
    root, server = printed.root, printed.server
    assert healthy(server.url), "the module's server is down: a test before this one left it so"
    port = int(server.url.rsplit(":", 1)[1])
    name = served_model(server.url).id
    # the worker is held by the test hook before its 6th task while the server is killed, then sends it there
    build = _init(root, "c", 40, server.model, server.url, server.staging, seed=41, hi=300, inflight=4)
    held = hold(6)
    err_path = root / "run-c.err"
    with open(err_path, "w") as err:
        run = forked.Popen(hsbuild_cmd("run", build, "--no-progress"), stdout=subprocess.PIPE, stderr=err,
                           text=True, env={**held.env, "HSBUILD_GROUP_SAMPLES": "1"})
    second = None
    try:
        held.wait(1, run, timeout=300)
        api = sorted(listening_pids(port))
        assert api, "no process listens on the server's port"
        engines = [p for p in scan_processes().values() if p.pgid == server.proc.pid and p.pid not in api
                   and (p.cmdline or ("",))[0].startswith("VLLM::")]
        assert engines, "the server runs no VLLM:: engine process"
        for pid in api:
            os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not healthy(server.url, timeout=2.0), 30, "the server to go")
        held.release()
        st = _wait_for(lambda: (s := _status(build)) and s.get("paused") and s, 60, "the run to pause")
        assert st["pause_reason"] == "server_unavailable", st

        # doctor names what the crash left behind, with a command that ends it
        doc = json.loads(hsbuild("doctor", build, "--json").stdout)
        orphans = next(c for c in doc["checks"] if c["name"] == "env.engine_orphans")
        named = {o["pid"] for o in orphans["data"]["processes"]}
        assert orphans["status"] != "ok" and {p.pid for p in engines} <= named, orphans
        assert subprocess.run(["bash", "-c", orphans["fix"]], capture_output=True).returncode == 0, orphans["fix"]
        _wait_for(lambda: not any(p.alive and p.pid in named for p in scan_processes().values()), 30,
                  "the kill command to end the engine processes")

        # the user restarts "the server" on the same address, under the same name: with another model
        written_before = written_count(build)
        second = start_server(root, other_llama, server.staging, port=port, extra=("--served-model-name", name))
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
        if second is not None:
            stop_server(second.proc)
    text = err_path.read_text()
    assert run.returncode == 4, text
    assert f"serves the model {other_llama}, the build's is {server.model}" in text, text
    with EventLog(layout(build).events, read_only=True) as log:
        written = log.query("SELECT count(*) FROM samples WHERE state = 'written'")[1][0][0]
        # in flight when the server went: back to pending (a transient failure, no attempt), none failed for good
        assert log.query("SELECT count(*) FROM samples WHERE state = 'failed' AND error <> 'server_unavailable' "
                         "OR attempts > 1")[1][0][0] == 0
    assert written >= written_before > 0
    # what was written before the crash is the build's model's: nothing of the other model got in
    assert _check_against_transformers(build, server.model, "pre_norm") == written
