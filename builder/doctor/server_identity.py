"""Which model, which layers and which staging folder a vLLM server serves, read from the server itself.

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

import hashlib
import ipaddress
import json
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlparse

from builder.procfs import ancestors, cmdline, listening_pids

# connectors that stage each build into its own subfolder (builder/extract/backends/vllm_connector.py)
BUILD_CONNECTORS = ("HsbuildHiddenStatesConnector", "CpuHiddenStatesConnector")
CONNECTOR_MODULE = "builder.extract.backends.vllm_connector"
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


def staging_name(meta: dict) -> str:
    """The build's own subfolder of the staging folder, named by the build's id (a digest of when and from what
    `init` made it: the same for every run of the build, another after `init --force`)."""
    raw = f"{meta.get('created_at')!r}|{meta.get('config_fingerprint')}|{meta.get('source')}"
    return "build-" + hashlib.sha256(raw.encode()).hexdigest()[:16]


def is_local(host: str) -> bool:
    """The host is this machine (a loopback address, or one this machine can bind)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    try:
        addr = socket.getaddrinfo(host, None)[0][4][0]
        if ipaddress.ip_address(addr).is_loopback:
            return True
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except (OSError, ValueError, IndexError):
        return False


def read_server_config(server: str) -> ServedConfig | str:
    """The configuration of the vLLM server listening at `server`, or why it cannot be read (one line)."""
    url = urlparse(server)
    host, port = url.hostname or "", url.port
    if not port:
        return f"{server} names no port"
    if not is_local(host):
        return f"{server} is on another host: its command line cannot be read from here"
    pids = sorted(listening_pids(port))
    found = [c for c in (parse_cmdline(p, cmdline(p) or []) for p in pids) if c is not None]
    if not found:
        what = (f"the process listening on port {port} (pid {', '.join(map(str, pids))}) is not a vLLM server "
                "command hsbuild can read (a proxy, a container?)" if pids else
                f"no process of this machine's namespace listens on port {port} (a container or another "
                "namespace?)")
        return what
    # a server's children may hold its listening socket too: the outermost command is the server's
    mains = [c for c in found if not any(o.pid != c.pid and o.pid in ancestors(c.pid) for o in found)]
    return mains[0]


def _same_path(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def config_problems(c: ServedConfig, want: Expected) -> list[str]:
    """What in a server's configuration does not fit a build (each a phrase naming both sides)."""
    out = []
    if not _same_path(c.model, want.model):
        out.append(f"serves the model {c.model}, the build's is {want.model}")
    if c.layer_ids is None:
        out.append("runs without the extract_hidden_states method (no eagle_aux_hidden_state_layer_ids)")
    elif list(c.layer_ids) != list(want.layer_ids):
        out.append(f"serves layer ids {list(c.layer_ids)}, the build's are {list(want.layer_ids)}")
    if not _same_path(c.staging, want.staging):
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


def in_server_cwd(pid: int, path: str | None) -> str | None:
    """A relative path of a process's command line, as that process sees it (against its working directory)."""
    if path is None or os.path.isabs(path):
        return path
    try:
        return os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
    except OSError:
        return path


@dataclass(frozen=True)
class ServerCheck:
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


def check_server(c: ServerCheck) -> dict:
    """Check that the server at `c.server` serves the build's model, layers and staging folder: its command
    line (a local server), /v1/models, then one probe (slots, hidden size, dtype, and the reference states when
    known). Returns what was found (recorded in the run's events). Raises ServerRefused (one line naming both
    sides) when it is not the build's, or when its configuration cannot be read and `trust` is off;
    EngineUnavailable when it went away meanwhile."""
    from builder.errors import UsageError  # noqa: PLC0415
    from builder.extract.backends.http_client import ServerRefused, served_model  # noqa: PLC0415
    from builder.extract.backends.vllm_server import probe, probe_problems, signature_differs  # noqa: PLC0415

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
        conf = ServedConfig(conf.pid, in_server_cwd(conf.pid, conf.model), conf.layer_ids, in_server_cwd(conf.pid, conf.staging),
                            conf.connector, conf.connector_module, conf.dtype, conf.flags, conf.served_names)
        problems = config_problems(conf, c.expected)
        if problems:
            raise ServerRefused(f"{c.server} (pid {conf.pid}) " + "; ".join(problems) + f"; {fix}")
        found["process"] = conf.as_dict()
    m = served_model(c.server)
    if not found.get("trusted") and not _same_path(m.root, c.expected.model) and not _same_path(
            in_server_cwd(conf.pid, m.root), c.expected.model):
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
