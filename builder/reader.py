"""The stable import for training code: `from builder.reader import HiddenStateDataset, collate_concat`.

The reader lives in builder/formats/reader.py, beside the trainer formats."""

from builder.formats.reader import HiddenStateDataset, collate_concat

__all__ = ["HiddenStateDataset", "collate_concat"]
