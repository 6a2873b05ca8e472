"""A build's recorded metadata and its model's, read without the run: what `init` recorded in data/zarr.json
(recomputed for builds older than that), the model's metadata and tokenizer, the build's source samples as `init`
tokenized them. Used by init, rebuild-log, serve-command and import."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from builder import __version__
from builder.config import BuildConfig
from builder.errors import UsageError
from builder.extract.source import load_source
from builder.extract.spec import ModelInfo, is_builtin
from builder.layout import BuildLayout
from builder.store.codec import STORAGE_DTYPES

if TYPE_CHECKING:
    from builder.extract.model import Extractor


def model_info(model: str, aux_layers: list[int] | None, dtype: str, final_state: str) -> Extractor | ModelInfo:
    """The model's metadata, tokenizer and checks: a Hugging Face directory's read from its files without torch
    (ModelInfo); the built-in model's from the model itself (its fingerprint hashes its generated weights)."""
    if not is_builtin(model):
        return ModelInfo.read(model, aux_layers, dtype, final_state)
    from builder.extract.model import Extractor  # noqa: PLC0415 - (torch: not at import)

    return Extractor(model, aux_layers, dtype, device="cpu", load_weights=False, final_state=final_state)


def recorded_meta(lay: BuildLayout) -> dict:
    """The build's metadata as `init` recorded it in data/zarr.json (builds made before that: recomputed from
    hsbuild.toml and the model's config, as `init` computed it)."""
    try:
        attrs = json.loads((lay.data / "zarr.json").read_bytes()).get("attributes", {})
    except (OSError, ValueError) as e:
        raise UsageError(f"{lay.data / 'zarr.json'}: unreadable ({e}); the data group's metadata is needed to "
                         "rebuild the log") from None
    if isinstance(attrs.get("hsbuild_meta"), dict):
        return attrs["hsbuild_meta"]
    cfg = BuildConfig.from_toml(lay.config)
    ex = model_info(cfg.model, cfg.aux_layers, cfg.dtype, "post_norm")
    return {"layout_version": int(attrs.get("hsbuild_layout", 1)), "hsbuild_version": __version__,
            "created_at": time.time(), "source": cfg.source, "config_fingerprint": cfg.fingerprint(),
            "chunk_tokens": cfg.chunk_tokens, "codec": cfg.codec, "storage_dtype": STORAGE_DTYPES[cfg.dtype],
            **ex.metadata()}


def source_samples(lay: BuildLayout) -> list:
    """The build's source samples, tokenized as `init` did."""
    cfg = BuildConfig.from_toml(lay.config)
    return load_source(cfg.source, model_info(cfg.model, None, cfg.dtype, "post_norm").tokenizer,
                       regenerate=cfg.turns_read())
