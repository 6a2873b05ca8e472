"""The engine seam (docs/design.md section 12): an engine is one plug-in, found through the registry by name.

- A toy engine from one file (tests/extract/toy_engine.py), installed the way a plug-in package is (an entry point
  in the group `hsbuild.backends`, in a `.dist-info` on the path: no edit anywhere in hsbuild), runs a real build
  end to end through the CLI: `init --backend toy`, `serve-command`, `run --launch` (the toy's server command
  launched, its identity checked, its states staged, read under their locks and stored), `status`, `verify`,
  `doctor`. Each command is a fresh process, as a user's would be.
- No module outside builder/extract/backends/vllm/ imports vLLM or names it: the core reaches it through the
  registry only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOMY, random_rows, write_jsonl

import builder
from builder.extract.backends import registry
from builder.extract.backends.registry import BackendSpec
from builder.layout import layout
from builder.log.query import run_query
from builder.reader import HiddenStateDataset

HERE = Path(__file__).resolve().parent
PKG = Path(builder.__file__).resolve().parent
REPO = PKG.parent


def _install(tmp_path: Path, entry_points: str) -> dict[str, str]:
    """The environment of a machine where a plug-in package declaring `entry_points` is installed: its metadata
    (a .dist-info, as pip writes it) and its module (toy_engine.py, where it is) on the path."""
    site = tmp_path / "site"
    dist = site / "hsbuild_toy_engine-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hsbuild-toy-engine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[hsbuild.backends]\n{entry_points}\n")
    path = [str(site), str(HERE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toy_states(token_ids: list[int], ids: list[int], hidden: int) -> np.ndarray:
    """What the toy server computes (toy_engine.states), written out here as the test's own oracle."""
    t = np.asarray(token_ids, dtype=np.int64)[:, None, None]
    layer = np.asarray(ids, dtype=np.int64)[None, :, None]
    h = np.arange(hidden, dtype=np.int64)[None, None, :]
    return (((t * 31 + layer * 7 + h) % 97).astype(np.float32) / 97) - 0.5


def test_a_toy_engine_from_one_file_runs_a_build_end_to_end(tmp_path, cli_proc):
    env = _install(tmp_path, "toy = toy_engine")
    n = 6
    rows = random_rows(n, seed=7, lo=5, hi=40)
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    staging = tmp_path / "staging"
    staging.mkdir()
    url = f"http://127.0.0.1:{_free_port()}"
    b = tmp_path / "b"

    cp = cli_proc("init", b, "--source", src, "--backend", "toy", "--server", url, "--staging", staging,
                  "--dtype", "float32", "--low", ROOMY.low, "--high", ROOMY.high, "--flood", ROOMY.flood, env=env)
    assert cp.returncode == 0, cp.stderr
    cp = cli_proc("init", "--help", env=env)  # the choices and the help come from the registry
    assert "--backend {inprocess,toy,vllm}" in cp.stdout and "toy: a toy server makes up the" in cp.stdout, cp.stdout

    cp = cli_proc("serve-command", b, env=env)  # the plug-in's command, as printed
    assert cp.returncode == 0, cp.stderr
    assert str(HERE / "toy_engine.py") in cp.stdout and f"--port {url.rsplit(':', 1)[1]}" in cp.stdout, cp.stdout

    cp = cli_proc("run", b, "--launch", "--workers", "1", "--no-progress", env=env, timeout=240)
    assert cp.returncode == 0, cp.stdout + cp.stderr

    lay = layout(b)
    _, probe = run_query(lay, "SELECT detail FROM events WHERE kind = 'engine_probe'")
    found = json.loads(probe[0][0])
    assert found["model_id"] == "toy" and found["launched"] is True and found["process"]["ids"] == [2, 4, 5, 8]
    ds = HiddenStateDataset(b)
    assert len(ds) == n
    by_id = {r["id"]: r["input_ids"] for r in rows}
    for i in range(n):
        item = ds[i]
        want = _toy_states(by_id[item["sample_id"]], [2, 4, 5, 8], 256)  # builtin: 8 layers, aux 2, 4, 5
        assert np.array_equal(item["aux_hidden_state"].numpy(), want[:, :3, :].reshape(len(want), -1))
        assert np.array_equal(item["hidden_state"].numpy(), want[:, 3, :])  # id L: the pre-norm final state
    assert list(staging.iterdir()) == [], "the run left its staging subfolder behind"

    cp = cli_proc("status", b, "--json", env=env)
    assert cp.returncode == 0 and json.loads(cp.stdout)["done"] == n, cp.stdout
    cp = cli_proc("verify", b, env=env)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    cp = cli_proc("doctor", b, "--json", env=env)  # the plug-in's doctor check: the default one, /health
    server = next(c for c in json.loads(cp.stdout)["checks"] if c["name"] == "env.server")
    assert server["status"] == "warn" and server["summary"].startswith(f"toy server {url} is not reachable"), server


def test_a_broken_plugin_is_named_when_asked_for_and_never_takes_the_others_down(tmp_path, cli_proc):
    env = _install(tmp_path, "toy = toy_engine\nbroken = no_such_module_here")
    src = write_jsonl(tmp_path / "src.jsonl", random_rows(2))
    cp = cli_proc("init", tmp_path / "b", "--source", src, "--backend", "broken", env=env)
    assert cp.returncode == 2, cp.stderr
    assert ("--backend broken: its plug-in cannot be loaded (hsbuild.backends entry point broken = "
            "no_such_module_here: ModuleNotFoundError") in cp.stderr, cp.stderr
    cp = cli_proc("init", "--help", env=env)
    assert "--backend {inprocess,toy,vllm}" in cp.stdout, cp.stdout


def test_a_plugin_never_replaces_a_registered_backend():
    def _open(settings, recheck=None):  # noqa: ANN001, ANN202, ARG001
        return None, None

    with pytest.raises(ValueError, match=r"^backend 'vllm': registered by builder\.extract\.backends\.vllm already, "
                                         rf"not again by {__name__}$"):
        registry.register(BackendSpec(name="vllm", summary="another", open=_open))
    assert registry.get("vllm").summary == "a vLLM server runs the model"


# -- nothing outside the package names vLLM --------------------------------------------------------------------

PACKAGE = PKG / "extract" / "backends" / "vllm"
# the old path of the connectors vLLM loads (`kv_connector_module_path` of older serve-command lines): an alias
ALIAS = PKG / "extract" / "backends" / "vllm_connector.py"
# where "vllm" is not the engine: the trainer formats name speculators' layer numbering after it
# (`vllm_eagle_aux_hidden_state_layer_ids`, `--layers vllm`)
NOT_THE_ENGINE = {"formats", "cli/exchange.py"}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if PACKAGE not in p.parents and p != ALIAS)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_no_module_outside_the_vllm_package_imports_vllm():
    found = [f"{p.relative_to(PKG)} imports {m}" for p in _modules() for m in _imports(p)
             if m == "vllm" or m.startswith(("vllm.", "builder.extract.backends.vllm"))]
    assert found == []


def _exempt(path: Path) -> bool:
    rel = path.relative_to(PKG).as_posix()
    return any(rel == e or rel.startswith(e + "/") for e in NOT_THE_ENGINE)


def test_no_module_outside_the_vllm_package_names_vllm():
    """The core (run/, doctor/, cli/, config, the registry and every other backend module) reaches vLLM through the
    registry by the name a build records, and lists registered names from the registry: it never writes the name."""
    named = [f"{p.relative_to(PKG)}:{i}: {line.strip()}" for p in _modules() if not _exempt(p)
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search("vllm", line, re.IGNORECASE)]
    assert named == []
    still = {e for e in NOT_THE_ENGINE
             if any(_exempt(p) and "vllm" in p.read_text().lower() and p.relative_to(PKG).as_posix().startswith(e)
                    for p in _modules())}
    assert still == NOT_THE_ENGINE, f"no longer names it: drop {sorted(NOT_THE_ENGINE - still)} from NOT_THE_ENGINE"
