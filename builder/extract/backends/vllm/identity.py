"""Which model, which layers and which staging folder a vLLM server serves, read from the server itself: the
vLLM backend's identity check (builder/extract/backends/serving.py, ServerIdentity).

A probe's answer tells the number of layer slots, the hidden size and the dtype, never WHICH layers: a server
started for layers [2, 4, 5, 8] answers a build of layers [1, 3, 6, 8] with states of the same shape. So before a
run sends a sample (and again every time the server comes back), hsbuild reads the server's configuration:

- the process listening on the server's port (a local server: its command line under /proc): the model it
  loaded, `eagle_aux_hidden_state_layer_ids`, the connector and its staging folder, the dtype, and that prefix
  caching and chunked prefill are off;
- `/v1/models`: the root the served model was loaded from.

A server whose configuration cannot be read (on another host, in another PID or network namespace, behind a
proxy) is refused unless the user says `--trust-server`; then only its answers are checked (`probe_problems`,
and from the build's second run the probe's reference states).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import UsageError
from builder.extract.backends.http_client import EngineUnavailable, ServerRefused, served_model
from builder.extract.backends.local_server import in_process_cwd, same_path, server_process
from builder.extract.backends.serving import NeverFits
from builder.extract.backends.staging import never_fits
from builder.extract.backends.vllm.states import staged_file_bytes

# connectors that stage each build into its own subfolder (builder/extract/backends/vllm/connector.py)
BUILD_CONNECTORS = ("HsbuildHiddenStatesConnector", "CpuHiddenStatesConnector")
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ServedConfig:
    """A vLLM server's configuration, as its command line gives it."""

    pid: int
    model: str | None
    layer_ids: list[int] | None
    staging: str | None
    connector: str | None
    connector_module: str | None
    dtype: str | None
    flags: frozenset[str] = field(default_factory=frozenset)  # the boolean flags given (--no-enable-...)
    served_names: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"pid": self.pid, "model": self.model, "layer_ids": self.layer_ids, "staging": self.staging,
                "connector": self.connector, "dtype": self.dtype}


@dataclass(frozen=True)
class Expected:
    """What a build needs its server to serve."""

    model: str  # the local model directory (absolute)
    layer_ids: list[int]  # engine layer ids (aux layers and L)
    staging: str  # the server's staging folder (the build stages in its own subfolder of it)
    dtype: str


def _options(argv: list[str]) -> tuple[dict[str, str], set[str], list[str]]:
    """(--option value pairs, bare flags, positionals) of a command line; `--a=b` and `--a b` alike; option
    names with `_` read as `-` (vLLM's argparse takes both)."""
    opts: dict[str, str] = {}
    flags: set[str] = set()
    pos: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            name = "--" + name[2:].replace("_", "-")
            if eq:
                opts[name] = val
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                opts[name] = argv[i + 1]
                i += 1
            else:
                flags.add(name)
        else:
            pos.append(a)
        i += 1
    return opts, flags, pos


def is_vllm_server(argv: list[str]) -> bool:
    """A vLLM OpenAI API server: `vllm serve ...` or `python -m vllm.entrypoints.openai.api_server ...`."""
    joined = " ".join(argv[:4])
    return "vllm.entrypoints.openai.api_server" in joined or (
        len(argv) >= 2 and os.path.basename(argv[0]).startswith("vllm") and argv[1] == "serve") or (
        len(argv) >= 3 and "python" in os.path.basename(argv[0]) and os.path.basename(argv[1]).startswith("vllm")
        and argv[2] == "serve")


def parse_cmdline(pid: int, argv: list[str]) -> ServedConfig | None:
    """The configuration a vLLM server command line gives; None when it is not one."""
    if not is_vllm_server(argv):
        return None
    opts, flags, pos = _options(argv)
    model = opts.get("--model")
    if model is None and "serve" in pos:  # `vllm serve MODEL`
        after = pos[pos.index("serve") + 1:]
        model = after[0] if after else None
    layer_ids = staging = connector = module = None
    try:
        spec = json.loads(opts.get("--speculative-config", "null")) or {}
        ids = (spec.get("draft_model_config") or {}).get("hf_config", {}).get("eagle_aux_hidden_state_layer_ids")
        layer_ids = [int(x) for x in ids] if ids is not None else None
    except (ValueError, TypeError, AttributeError):
        pass
    try:
        kv = json.loads(opts.get("--kv-transfer-config", "null")) or {}
        connector, module = kv.get("kv_connector"), kv.get("kv_connector_module_path")
        staging = (kv.get("kv_connector_extra_config") or {}).get("shared_storage_path")
    except (ValueError, TypeError, AttributeError):
        pass
    names = tuple(opts["--served-model-name"].split()) if "--served-model-name" in opts else ()
    return ServedConfig(pid, model, layer_ids, staging, connector, module, opts.get("--dtype"), frozenset(flags),
                        names)


def read_server_config(server: str) -> ServedConfig | str:
    """The configuration of the vLLM server listening at `server` (its paths as the server sees them), or why it
    cannot be read (one line)."""
    found = server_process(server, parse_cmdline, "vLLM")
    if isinstance(found, str):
        return found
    pid, conf = found
    return dataclasses.replace(conf, model=in_process_cwd(pid, conf.model), staging=in_process_cwd(pid, conf.staging))


def config_problems(c: ServedConfig, want: Expected) -> list[str]:
    """What in a server's configuration does not fit a build (each a phrase naming both sides)."""
    out = []
    if not same_path(c.model, want.model):
        out.append(f"serves the model {c.model}, the build's is {want.model}")
    if c.layer_ids is None:
        out.append("runs without the extract_hidden_states method (no eagle_aux_hidden_state_layer_ids)")
    elif list(c.layer_ids) != list(want.layer_ids):
        out.append(f"serves layer ids {list(c.layer_ids)}, the build's are {list(want.layer_ids)}")
    if not same_path(c.staging, want.staging):
        out.append(f"stages into {c.staging}, the build's staging folder is {want.staging}")
    if c.connector not in BUILD_CONNECTORS:
        out.append(f"uses the connector {c.connector}, which does not stage each build into its own subfolder "
                   f"(hsbuild's {' or '.join(BUILD_CONNECTORS)})")
    dtype = DTYPE_ALIASES.get(c.dtype or "auto", c.dtype)
    if dtype != "auto" and dtype != want.dtype:
        out.append(f"runs with --dtype {c.dtype}, the build stores {want.dtype}")
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill"):
        if flag not in c.flags:
            out.append(f"runs without {flag} (a cached or split prefill leaves states out of the file)")
    return out


@dataclass(frozen=True)
class VllmIdentity:
    """Everything that checks a server is the build's: the run's first check and every check after the server
    came back (in the worker that talks to it: a small picklable value)."""

    server: str
    expected: Expected
    staging_dir: str  # the build's own subfolder of the server's staging folder: the probe's file goes there
    vocab_size: int
    hidden_size: int
    build_root: str
    reference: list[list[float]] | None = None  # the build's first probe (else this run's first): same states
    model_name: str | None = None  # the name requests use, once known: a server back under another is refused
    trust: bool = False  # --trust-server: a server whose configuration cannot be read is judged by its answers

    def check(self) -> dict:
        """`check_server`; a probe that could not be staged on a volume too small even for its file raises
        NeverFits (the probe's file is the smallest a run stages)."""
        try:
            return check_server(self)
        except NeverFits:
            raise
        except EngineUnavailable:
            from builder.extract.backends.vllm.probe import PROBE_TOKENS  # noqa: PLC0415

            least = staged_file_bytes(PROBE_TOKENS, len(self.expected.layer_ids), self.hidden_size,
                                      self.expected.dtype)
            too_small = never_fits(Path(self.staging_dir), PROBE_TOKENS, least)
            if too_small is not None:
                raise NeverFits(too_small) from None
            raise

    def confirmed(self, found: dict) -> VllmIdentity:
        """The check again with the build's reference probe (this run's on the build's first run) and the name
        the server serves the model under."""
        return dataclasses.replace(self, reference=self.reference or found["signature"], model_name=found["model_id"])


def check_server(c: VllmIdentity) -> dict:
    """Check that the server at `c.server` serves the build's model, layers and staging folder: its command
    line (a local server), /v1/models, then one probe (slots, hidden size, dtype, and the reference states when
    known). Returns what was found (recorded in the run's events). Raises ServerRefused (one line naming both
    sides) when it is not the build's, or when its configuration cannot be read and `trust` is off;
    EngineUnavailable when it went away meanwhile."""
    from builder.extract.backends.vllm.probe import probe, probe_problems, signature_differs  # noqa: PLC0415

    fix = f"serve the build with the command `hsbuild serve-command {c.build_root}` prints"
    found: dict = {}
    conf = read_server_config(c.server)
    if isinstance(conf, str):
        if not c.trust:
            raise ServerRefused(f"{c.server}: cannot tell which model and layers it serves ({conf}); run the server on "
                                "this machine, or pass --trust-server to rely on its answers alone (recorded in the "
                                "run's events)")
        found["trusted"] = conf
    else:
        problems = config_problems(conf, c.expected)
        if problems:
            raise ServerRefused(f"{c.server} (pid {conf.pid}) " + "; ".join(problems) + f"; {fix}")
        found["process"] = conf.as_dict()
    m = served_model(c.server)
    if not found.get("trusted") and not same_path(m.root, c.expected.model) and not same_path(
            in_process_cwd(conf.pid, m.root), c.expected.model):
        raise ServerRefused(f"{c.server}: /v1/models says it serves {m.root}, the build's model is "
                            f"{c.expected.model}; {fix}")
    if c.model_name is not None and m.id != c.model_name:
        raise ServerRefused(f"{c.server}: now serves its model as {m.id!r}, this run sends {c.model_name!r} (the "
                            "server was restarted with another name); resume the build to go on")
    try:
        p = probe(c.server, c.vocab_size, staging=c.staging_dir)
    except UsageError as e:
        raise ServerRefused(str(e)) from None
    problems = probe_problems(p, c.expected.layer_ids, c.hidden_size, c.expected.dtype)
    if not problems and c.reference:
        rel = signature_differs(p.signature, c.reference)
        if rel is not None:
            problems.append(f"returns other states for the probe prompt than the build's reference probe (largest "
                            f"relative difference {rel:.1%}): another model or other layers")
    if problems:
        raise ServerRefused(f"{c.server} (serving {p.root}): " + "; ".join(problems) + f"; {fix}")
    return {"model_id": p.model_id, "root": p.root, "layers": p.layers, "hidden": p.hidden, "dtype": p.dtype,
            "signature": p.signature, **found}
