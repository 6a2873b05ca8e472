"""The stable import for training code: `from builder.reader import HiddenStateDataset, collate_concat`.

The torch dataset lives in builder/reader/dataset.py; speculators' transfer plugin in
builder/reader/speculators_transfer.py (imported only on request: it needs hs_connectors)."""

from builder.reader.dataset import HiddenStateDataset, collate_concat

__all__ = ["HiddenStateDataset", "collate_concat"]
