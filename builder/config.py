"""The build's configuration file, `hsbuild.toml`.

Written once by `init` (atomically); read by every command. Flags given to `run` override it for that run
only, and each run records what it used in its `run_started` event.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from builder.errors import ConfigChangedError, UsageError
from builder.fsutil import atomic_write_bytes
from builder.layout import BuildLayout


@dataclass
class Watermarks:
    """Disk-usage thresholds as fractions of capacity (Elasticsearch/Ceph defaults) plus absolute free bytes."""

    low: float = 0.85
    high: float = 0.90
    flood: float = 0.95
    min_free: int = 0

    def validate(self) -> Watermarks:
        if not (0.0 < self.low <= self.high <= self.flood <= 1.0):
            raise UsageError(
                f"watermarks: need 0 < low <= high <= flood <= 1, got low={self.low} high={self.high} "
                f"flood={self.flood}; fix [watermarks] in hsbuild.toml or the --low/--high/--flood flags"
            )
        if self.min_free < 0:
            raise UsageError("watermarks: min_free must be >= 0 bytes")
        return self


# The keys that decide what a stored sample looks like. A build holds one format: `init` records them (meta
# `format`), and a config whose format keys differ is refused by every run, with or without --force.
# The codec of a new build's arrays (`init --codec`), chosen on extracted states (tools/study_codecs.py): blosc's
# lz4 after a bit shuffle stores bf16 states as small as zstd:1 or smaller, and encodes and decodes them faster.
DEFAULT_CODEC = "blosc-lz4-bitshuffle:5"
CODEC_SPECS = "zstd:LEVEL, blosc-lz4:LEVEL, blosc-zstd:LEVEL, blosc-lz4-bitshuffle:LEVEL, blosc-zstd-bitshuffle:LEVEL or none"
FORMAT_KEYS = ("model", "aux_layers", "max_tokens", "dtype", "codec", "chunk_tokens", "backend", "final_state",
               "quantize")
QUANTIZE = ("none", "fp8")  # how states are stored: exactly, or fp8 with a scale a token (opt-in, lossy)
POSITIVE_INTS = ("max_tokens", "max_attempts", "chunk_tokens", "inflight", "batch_tokens")
AUTO_WORKERS = "auto"  # `workers`: sized from the host at each run's start (builder/run/sizing.py)
UNKNOWN = object()  # a value at init that an old build did not record


def is_count(v: object) -> bool:
    """An integer >= 1 (a bool is not one, though Python calls it an int)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass
class BuildConfig:
    source: str
    model: str = "builtin"
    aux_layers: list[int] = field(default_factory=list)  # Hugging Face hidden_states indices
    max_tokens: int | None = None
    max_attempts: int = 3
    dtype: str = "bfloat16"
    codec: str = DEFAULT_CODEC
    chunk_tokens: int = 128
    workers: int | str = AUTO_WORKERS  # a number, or auto (older builds recorded 1)
    device: str = "auto"
    staging: str | None = None
    verify_after_write: bool = False
    # which backend runs the forward passes (builder/extract/backends/registry.py: each declares the keys below
    # it reads, and their defaults; `hsbuild init --help` lists them)
    backend: str = "inprocess"
    server: str | None = None  # a server backend's URL (http://127.0.0.1:8000)
    inflight: int | None = None  # a server backend: requests in flight (default: its spec's)
    batch_tokens: int | None = None  # inprocess: samples packed into one forward pass up to this many tokens
    final_state: str = "post_norm"  # what `hidden_state` holds: the final norm's output, or its input
    quantize: str = "none"  # none: states stored exactly; fp8: float8_e4m3fn with a float32 scale a token (lossy)
    # the server's KV connector (serve-command, --launch); None: the engine's own default (hsbuild's, which stages
    # each build into its own subfolder: docs/design.md section 12)
    engine_connector: str | None = None
    engine_connector_module: str | None = None  # its module (kv_connector_module_path), with engine_connector
    engine_args: list[str] = field(default_factory=list)  # appended to the server command (--tensor-parallel-size 8)
    watermarks: Watermarks = field(default_factory=Watermarks)

    # -- serialisation -------------------------------------------------------------------------
    def to_toml(self) -> str:
        lines = ["# hsbuild build configuration (written by `hsbuild init`)"]
        wm = None
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "watermarks":
                wm = value
                continue
            if value is None:
                continue
            lines.append(f"{f.name} = {_toml_value(value)}")
        assert wm is not None
        lines.append("")
        lines.append("[watermarks]")
        for k, v in asdict(wm).items():
            lines.append(f"{k} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, path: Path) -> BuildConfig:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as e:
            raise UsageError(f"{path}: missing build config") from e
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"{path}: not valid TOML ({e}); fix or re-create it with `hsbuild init --force`") from e
        wm = data.pop("watermarks", {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UsageError(f"{path}: unknown key(s) {sorted(unknown)}; known keys: {sorted(known)}")
        wknown = {f.name for f in fields(Watermarks)}
        if set(wm) - wknown:
            raise UsageError(f"{path}: unknown key(s) in [watermarks]: {sorted(set(wm) - wknown)}")
        if "source" not in data:
            raise UsageError(f"{path}: field 'source' is required")
        try:
            cfg = cls(**data, watermarks=Watermarks(**wm))
        except TypeError as e:
            raise UsageError(f"{path}: {e}") from e
        for k in POSITIVE_INTS:
            v = getattr(cfg, k)
            if v is not None and not is_count(v):
                raise UsageError(f"{path}: {k} = {v!r}: must be an integer >= 1")
        if cfg.workers != AUTO_WORKERS and not is_count(cfg.workers):
            raise UsageError(f"{path}: workers = {cfg.workers!r}: must be \"{AUTO_WORKERS}\" or an integer >= 1")
        if not isinstance(cfg.engine_args, list) or not all(isinstance(a, str) for a in cfg.engine_args):
            raise UsageError(f"{path}: engine_args = {cfg.engine_args!r}: must be a list of strings")
        if not isinstance(cfg.aux_layers, list) or not all(isinstance(i, int) for i in cfg.aux_layers):
            raise UsageError(f"{path}: aux_layers = {cfg.aux_layers!r}: must be a list of integers")
        if cfg.quantize not in QUANTIZE:
            raise UsageError(f"{path}: quantize = {cfg.quantize!r}: use one of {', '.join(QUANTIZE)}")
        if not isinstance(cfg.backend, str) or not cfg.backend:
            raise UsageError(f"{path}: backend = {cfg.backend!r}: must name a backend")
        # (which names exist is the backends' registry's to say: builder/extract/backends/registry.py, asked by
        # every command that uses the backend)
        cfg.watermarks.validate()
        return cfg

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, self.to_toml().encode())

    def format_fields(self) -> dict:
        """The values of the format keys: everything that changes the bytes a sample produces. Keys added
        after the first release appear only when not at their default, so older builds keep their fingerprint."""
        later = {"backend": "inprocess", "final_state": "post_norm", "quantize": "none"}
        return {k: getattr(self, k) for k in FORMAT_KEYS if later.get(k, object()) != getattr(self, k)}

    def fingerprint(self) -> str:
        """Fingerprint of the format keys."""
        return hashlib.blake2b(json.dumps(self.format_fields(), sort_keys=True).encode(), digest_size=8).hexdigest()

    def format_changes(self, meta: dict) -> dict[str, tuple[object, object]]:
        """{key: (value at init, value now)} for each format key that changed since `init`.

        `meta` is the build's meta table: its `format` (recorded by init); builds from before that record have
        model, aux_layers, dtype, codec and chunk_tokens in meta and the config fingerprint, so a fingerprint
        that differs while those agree means max_tokens changed (its old value UNKNOWN)."""
        recorded = meta.get("format")
        if isinstance(recorded, dict):  # a key an older build did not record had its default value
            defaults = {f.name: f.default for f in fields(self)}
            was = {k: recorded.get(k, defaults.get(k)) for k in FORMAT_KEYS}  # noqa: B023
            return {k: (was[k], getattr(self, k)) for k in FORMAT_KEYS if was[k] != getattr(self, k)}
        if meta.get("config_fingerprint") in (None, self.fingerprint()):
            return {}
        changed = {k: (meta[k], getattr(self, k)) for k in FORMAT_KEYS if k in meta and meta[k] != getattr(self, k)}
        return changed or {"max_tokens": (UNKNOWN, self.max_tokens)}


def format_change_message(changes: dict[str, tuple[object, object]]) -> str:
    """One line naming the changed format keys and the two ways out (never --force)."""
    what = ", ".join(f"{k} {_toml_value_or_unknown(old)} -> {_toml_value_or_unknown(new)}"
                     for k, (old, new) in changes.items())
    return (f"hsbuild.toml changed the build's format since `init` ({what}): a build never holds two formats and "
            "--force does not override this; restore hsbuild.toml, or start a new build with "
            "`hsbuild init NEWDIR --source ...`")


def require_same_format(cfg: BuildConfig, meta: dict) -> None:
    """Raise ConfigChangedError when the config's format keys differ from the build's."""
    changes = cfg.format_changes(meta)
    if changes:
        raise ConfigChangedError(format_change_message(changes))


def _toml_value_or_unknown(v: object) -> str:
    if v is UNKNOWN:
        return "?"
    if v is None:
        return "(unset)"
    try:
        return _toml_value(v)
    except TypeError:
        return repr(v)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def load_config(lay: BuildLayout) -> BuildConfig:
    """The config of an existing build (raises BuildNotFoundError when `lay` is not a build)."""
    return BuildConfig.from_toml(lay.require().config)
