"""hsbuild: crash-safe, storage-aware builder of hidden-state training sets."""

__version__ = "0.1.0"
