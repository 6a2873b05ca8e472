"""The trainer formats hsbuild exports to, imports from and reads as: one module each, found through the registry
(builder/formats/registry.py); what a format is: builder/formats/base.py."""

from __future__ import annotations

from builder.formats.registry import get, make_format, names, register, unregister

__all__ = ["get", "make_format", "names", "register", "unregister"]
