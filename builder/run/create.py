"""Creating a build (`hsbuild init`) and opening one."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np

from builder import __version__
from builder.config import DEFAULT_CODEC, QUANTIZE, BuildConfig, Watermarks
from builder.errors import BuildExistsError, BuildReadOnlyError, ModelError, UsageError
from builder.extract.backends import registry as backends
from builder.extract.build_meta import model_info
from builder.extract.final_norm import (
    FinalNorm,
    RawFinalNorm,
    has_decoder_layers,
    read_final_norm,
    read_final_norm_raw,
)
from builder.extract.source import load_source
from builder.extract.spec import ModelInfo, check_device_spec, is_builtin, suggest_chunk_tokens
from builder.fsutil import fsync_path, make_dirs_durable
from builder.layout import BuildLayout, layout
from builder.log.events import Event, EventLog, detail
from builder.log.lock import BuildLock
from builder.store.codec import FP8_SCHEME, STORAGE_DTYPES, parse_codec
from builder.store.segment import LAYOUT_VERSION, init_data_group

if TYPE_CHECKING:
    from builder.extract.model import Extractor


def code_fingerprint() -> str:
    h = hashlib.blake2b(digest_size=8)
    pkg = Path(__file__).resolve().parent.parent
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


MAX_CHUNK_TOKENS = 1 << 20



def long_samples(samples, max_tokens: int | None, max_positions: int) -> dict | None:  # noqa: ANN001 - SourceSamples
    """The source's samples longer than what a run keeps of a sample, and what happens to them (what `init` says
    and records in its event): with --max-tokens, `cut` to it (their written events say how many tokens went,
    `truncated`); without it nothing is cut, and those longer than the model's positions `fail` (`too_long`).
    None when there are none."""
    limit = max_tokens if max_tokens is not None else max_positions
    lengths = np.asarray(samples.num_tokens)
    over = np.flatnonzero(lengths > limit)
    if not over.size:
        return None
    i = int(over[np.argmax(lengths[over])])
    return {"count": int(over.size), "limit": int(limit), "then": "cut" if max_tokens is not None else "fail",
            "longest": {"sample_id": samples[i].sample_id, "tokens": int(lengths[i])}}


def init_build(
    path: str | Path,
    source: str | Path,
    model: str = "builtin",
    aux_layers: list[int] | None = None,
    max_tokens: int | None = None,
    force: bool = False,
    codec: str = DEFAULT_CODEC,
    dtype: str = "bfloat16",
    chunk_tokens: int | None = None,
    max_attempts: int = 3,
    watermarks: Watermarks | None = None,
    device: str = "auto",
    staging: str | None = None,
    backend: str = "inprocess",
    server: str | None = None,
    inflight: int | None = None,
    final_state: str | None = None,
    quantize: str = "none",
) -> BuildLayout:
    """Create a build. Validates everything first: on any error nothing on disk changes.

    `force` replaces what a previous build (or a half-made one) left in the directory: its log, data, ballast
    and config; it refuses when one of those is not hsbuild's.

    Every path is recorded absolute (source, staging, a model directory), so that runs start from any directory
    and never find another directory's `models/A`. Builds made before this keep the model path they recorded
    (a relative one is still read relative to the directory a command runs from).

    `final_state` None (the default): `pre_norm`, which feeds every trainer (post-norm is derived from it with
    the kept final norm), where the model allows it; see `choose_final_state`. The choice and why is recorded
    in meta `final_state_choice`."""
    lay = layout(path)
    if lay.exists() and not force:
        raise BuildExistsError(f"{lay.root}: already holds a build; pass --force to replace it (its data is deleted)")
    if lay.root.is_dir() and not lay.exists() and any(lay.root.iterdir()) and not force:
        raise BuildExistsError(f"{lay.root}: directory is not empty; choose a new directory or pass --force")
    if lay.root.exists() and not lay.root.is_dir():
        raise UsageError(f"{lay.root}: exists and is not a directory; choose a new directory for the build")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens {max_tokens}: must be a positive number of tokens")
    if max_attempts < 1:
        raise UsageError(f"--max-attempts {max_attempts}: must be at least 1")
    if chunk_tokens is not None and not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise UsageError(f"--chunk-tokens {chunk_tokens}: must be between 1 and {MAX_CHUNK_TOKENS}")
    if dtype not in STORAGE_DTYPES:
        raise UsageError(f"--dtype {dtype}: use one of {sorted(STORAGE_DTYPES)}")
    if quantize not in QUANTIZE:
        raise UsageError(f"--quantize {quantize}: use one of {', '.join(QUANTIZE)}")
    if staging is not None:
        if not staging.strip() or not Path(staging).is_dir():
            raise UsageError(f"--staging '{staging}': not an existing directory; create it first, or leave "
                             "--staging out")
        staging = str(Path(staging).absolute())  # runs start from any directory
    if not is_builtin(model):  # a local directory: recorded as the one it names here, never resolved again
        if not model.strip():
            raise UsageError("--model '': give builtin[:...] or a local Hugging Face model directory")
        model = str(Path(model).absolute())
    parse_codec(codec)
    check_device_spec(device)
    wm = (watermarks or Watermarks()).validate()
    chosen = final_state is None
    ex = model_info(model, aux_layers, dtype, final_state or "pre_norm")
    ex.check_max_tokens(max_tokens)
    engine = check_backend(backend, server, staging, inflight, ex)
    returns = backends.get(backend).final_state
    try:
        norm = final_norm_of(ex)  # one tensor of the checkpoint
        no_norm = None
    except ModelError as e:
        if final_state is not None and returns not in (None, final_state):
            raise  # the backend returns the other final state (an engine: pre-norm): deriving it needs the norm
        norm, no_norm = None, str(e)
    final_state, why = choose_final_state(ex, final_state, backend, no_norm)
    if final_state != ex.final_state:
        ex = model_info(model, aux_layers, dtype, final_state)
    source = Path(source).absolute()
    samples = load_source(source, ex.tokenizer, vocab_size=ex.vocab_size)
    # what the workers store: samples cut to max_tokens (chunks sized for the uncut ones would be mostly padding)
    cut = samples.num_tokens if max_tokens is None else np.minimum(samples.num_tokens, max_tokens)
    median = int(np.median(cut)) if len(samples) else 128
    if chunk_tokens is None:
        chunk_tokens = suggest_chunk_tokens(ex.hidden_size, len(ex.aux_layers), median)
    cfg = BuildConfig(source=str(source), model=model, aux_layers=ex.aux_layers, max_tokens=max_tokens,
                      max_attempts=max_attempts, dtype=dtype, codec=codec, chunk_tokens=chunk_tokens, device=device,
                      staging=staging, watermarks=wm, backend=backend, server=server, inflight=inflight,
                      final_state=final_state, quantize=quantize)

    try:
        make_dirs_durable(lay.root)
    except OSError as e:
        raise BuildReadOnlyError(f"{lay.root}: cannot create the build directory ({e.strerror})") from None
    # the lock: a live run is never pulled out from under itself, and two inits never interleave
    with BuildLock(lay, "init --force" if force else "init"):
        if force:
            _remove_previous_build(lay)
        meta = {
            "layout_version": LAYOUT_VERSION,
            "hsbuild_version": __version__,
            "created_at": time.time(),
            "source": str(source),
            "config_fingerprint": cfg.fingerprint(),
            "format": cfg.format_fields(),
            "chunk_tokens": chunk_tokens,
            "codec": codec,
            "storage_dtype": "uint8" if quantize == "fp8" else STORAGE_DTYPES[dtype],
            **({"quantize": {"scheme": FP8_SCHEME, "lossy": True, "read_as": dtype,
                             "stored": "float8_e4m3fn values, then a float32 scale (max |x| / 448) a token, "
                                       "per state field"}} if quantize == "fp8" else {}),
            **ex.metadata(),
            **engine,
            "final_norm": None if norm is None else {"file": lay.final_norm.name, "eps": norm.eps},
            **({"final_state_choice": {"default": True, "why": why}} if chosen else {}),
        }
        if norm is not None:
            norm.save(lay.final_norm)
        # the data describes itself: the whole metadata is in data/zarr.json too (a lost log is rebuilt from it)
        init_data_group(lay.data, {**{k: meta[k] for k in ("model", "aux_layers", "convention", "dtype",
                                                           "storage_dtype", "hidden_size", "num_layers",
                                                           "chunk_tokens")}, "hsbuild_meta": meta})
        with EventLog(lay.events) as log:
            log.set_meta(meta)
            log.register_samples(samples)
            long = long_samples(samples, max_tokens, ex.max_positions)
            log.append([Event("init", detail=detail(samples=len(samples), tokens=samples.total_tokens,
                                                     **({"long": long} if long else {}),
                                                     **{k: meta[k] for k in ("model", "model_fingerprint",
                                                                              "aux_layers", "config_fingerprint")}))])
        cfg.save(lay.config)  # last: a build "exists" once its config is there
    return lay


def choose_final_state(ex: Extractor | ModelInfo, final_state: str | None, backend: str,
                       no_norm: str | None) -> tuple[str, str]:
    """(the final state a new build stores, why). Given: as given. By default `pre_norm`: it feeds every trainer
    (speculators reads it, SpecForge and Model-Optimizer read the post-norm state derived from it with the kept
    norm, bit-exactly; the reverse is impossible). An in-process build falls back to `post_norm` where that
    derivation is impossible (no final RMSNorm to keep: `no_norm` says why) or where hsbuild cannot find the
    decoder layers whose output it would store; an engine build stays `pre_norm` (its engine returns that state:
    the backend's spec says which final state it returns, if only one)."""
    if final_state is not None:
        return final_state, "given (--final-state)"
    spec = backends.get(backend)
    if no_norm is not None and spec.final_state is None:
        return "post_norm", f"the model's final norm cannot be kept ({no_norm.split('; use')[0]})"
    if no_norm is not None:
        return spec.final_state, (f"what the engine returns; the model's final norm cannot be kept "
                                  f"({no_norm.split('; use')[0]})")
    if isinstance(ex, ModelInfo) and spec.loads_model and not has_decoder_layers(Path(ex.spec)):
        return "post_norm", "hsbuild cannot find the model's decoder layers (model.layers.N) to keep the last one's output"
    return "pre_norm", "the default; post-norm is derived from it with the kept final norm"


def final_norm_of(ex: Extractor | ModelInfo) -> FinalNorm | RawFinalNorm:
    """The final norm the build keeps: copied as stored when the checkpoint has it in the build's dtype (no
    torch), else converted (torch)."""
    if isinstance(ex, ModelInfo):
        raw = read_final_norm_raw(Path(ex.spec), ex.dtype_name)
        if raw is not None:
            return raw
        from builder.store.dtypes import torch_dtype  # noqa: PLC0415 - (torch)

        return read_final_norm(Path(ex.spec), torch_dtype(ex.dtype_name))
    return ex.final_norm()


def check_backend(backend: str, server: str | None, staging: str | None, inflight: int | None,
                  ex: Extractor | ModelInfo) -> dict:
    """Validate the backend flags (what its spec asks: builder/extract/backends/registry.py); returns what the
    build records about its backend."""
    spec = backends.choose(backend)
    if inflight is not None and inflight < 1:
        raise UsageError(f"--inflight {inflight}: must be at least 1")
    backends.check_options(spec, {"server": server})
    if spec.server:
        if not server:
            raise UsageError(f"--backend {backend}: needs --server http://HOST:PORT (the server's URL)")
        if not server.startswith(("http://", "https://")):
            raise UsageError(f"--server {server}: not an http:// or https:// URL")
        if not staging:
            raise UsageError(f"--backend {backend}: needs --staging DIR, the folder the server writes states to "
                             "(the connector's shared_storage_path; /dev/shm/NAME on one node)")
    return {"backend": backend, **({"server": server} if spec.server else {}),
            **(spec.check_init(ex) if spec.check_init is not None else {})}


def _remove_previous_build(lay: BuildLayout) -> None:
    """What `init --force` replaces: the config, the log (+ WAL), the data group, the ballast, a stale socket.
    Checks all of them belong to hsbuild before removing any (the caller holds the build lock)."""
    wal = lay.wal
    sock = lay.root / "hsbuild.sock"
    if lay.events.exists():
        _require_event_log(lay.events)
    if lay.data.exists():
        _require_data_group(lay.data)
    for p in (lay.ballast, sock, lay.config):
        if p.is_dir():
            raise UsageError(f"{p}: is a directory, not hsbuild's; move it away, then run init again")
    # the config last: until the new one is written the directory is no build, whatever happens here
    for p in (lay.events, wal, lay.ballast, sock, lay.final_norm, lay.config):
        p.unlink(missing_ok=True)
    if lay.data.exists():
        shutil.rmtree(lay.data)
    fsync_path(lay.root)


def _require_event_log(path: Path) -> None:
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as e:
        raise UsageError(f"{path}: not an hsbuild event log that init --force may replace "
                         f"({str(e).splitlines()[0]}); move it away, then run init again") from None
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    finally:
        con.close()
    if not {"meta", "events"} <= tables:
        raise UsageError(f"{path}: a DuckDB file that is not an hsbuild event log (no meta/events tables); "
                         "move it away, then run init again")


def _require_data_group(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        return
    try:
        attrs = json.loads((path / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        attrs = {}
    if not path.is_dir() or not isinstance(attrs, dict) or "hsbuild_layout" not in attrs:
        raise UsageError(f"{path}: not an hsbuild data group (no hsbuild attributes in zarr.json), so init --force "
                         "will not delete it; move it away, then run init again")
