"""The trainer formats hsbuild exports to, imports from and reads as: one module each."""

from __future__ import annotations

from builder.errors import FormatError
from builder.formats.base import TrainerFormat

EXPORT_FORMATS = ("specforge", "speculators", "modelopt")
IMPORT_FORMATS = (*EXPORT_FORMATS, "pt")


def make_format(name: str, max_len: int | None = None, compress: int | None = None,
                final_state: str = "post_norm") -> TrainerFormat:
    if name == "specforge":
        from builder.formats.specforge import SpecForge  # noqa: PLC0415

        return SpecForge(max_len=max_len, compress=compress)
    if compress is not None:
        raise FormatError(f"--compress: only the specforge format compresses its files (not {name})")
    if max_len is not None:
        raise FormatError(f"--max-len: only specforge's dataset truncates samples (not {name})")
    if name == "speculators":
        from builder.formats.speculators import Speculators  # noqa: PLC0415

        return Speculators()
    if name == "modelopt":
        from builder.formats.modelopt import ModelOpt  # noqa: PLC0415

        return ModelOpt()
    if name == "pt":
        from builder.formats.pt import PlainPt  # noqa: PLC0415

        return PlainPt(final_state)
    raise FormatError(f"--format {name}: use one of {', '.join(IMPORT_FORMATS)}")
