"""Deprecated: moved to builder.reader.speculators_transfer; this old import path still works, with a warning.

Importing it imports the real module, which registers the "hsbuild" backend in speculators' registry as before.
(tests/test_layering.py allows this alias, and only it, to import upward.)
"""

import warnings

warnings.warn("builder.formats.speculators_transfer moved to builder.reader.speculators_transfer",
              DeprecationWarning, stacklevel=2)

from builder.reader.speculators_transfer import HsbuildTransfer  # noqa: E402

__all__ = ["HsbuildTransfer"]
