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

from builder.errors import UsageError
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


@dataclass
class BuildConfig:
    source: str
    model: str = "builtin"
    aux_layers: list[int] = field(default_factory=list)  # Hugging Face hidden_states indices
    max_tokens: int | None = None
    max_attempts: int = 3
    dtype: str = "bfloat16"
    codec: str = "zstd:1"
    chunk_tokens: int = 128
    workers: int = 1
    device: str = "auto"
    staging: str | None = None
    verify_after_write: bool = False
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
        cfg.watermarks.validate()
        return cfg

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, self.to_toml().encode())

    def fingerprint(self) -> str:
        """Fingerprint of everything that changes the bytes a sample produces."""
        keyed = {k: getattr(self, k) for k in ("model", "aux_layers", "max_tokens", "dtype", "codec", "chunk_tokens")}
        return hashlib.blake2b(json.dumps(keyed, sort_keys=True).encode(), digest_size=8).hexdigest()


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
