"""`hsbuild`: the command line, thin over the library. Only this package prints, renders progress and picks
exit codes."""

from builder.cli.app import entry, main

__all__ = ["entry", "main"]
