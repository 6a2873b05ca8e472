"""One interface for every trainer format: what the trainer's dataset yields for a sample (`item`), the files an
export writes for it (`sample_files`) and at the end (`finish_files`), and, for import, where a dump keeps each
sample (`scan`) and what one file holds (`load`).

A format never touches the build: the export/import drivers read and write it, with checksums, atomic files and
the event log. A format module only knows its trainer's conventions (layout, keys, dtypes, shapes, layer
numbering, final state before or after the norm), each checked against the trainer's own code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass
class Sample:
    """One live sample as a trainer format sees it: int64 tokens and mask, the aux states [n, n_aux*H] and the
    final state [n, H] already in the convention the format asked for (`TrainerFormat.final_state`)."""

    sample_id: str
    row: int  # the source row
    index: int  # its row in the export (dense over the exported samples, 0-based): formats number files by it
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Exported:
    """What an export keeps of each sample for the files written at its end (datasets, vocab mappings)."""

    sample_id: str
    index: int
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Loaded:
    """One dump file, validated by its format: tokens, optional mask, aux [n, n_aux*H], final [n, H] in the
    convention `final_state`."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    aux: torch.Tensor
    final: torch.Tensor
    final_state: str


class Rejected(ValueError):  # noqa: N818 - a file that is not a usable sample: the reason goes to the report
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class TrainerFormat(Protocol):
    name: str
    final_state: str  # the final state its files and items hold: "post_norm" or "pre_norm"
    layer_convention: str  # the key of BuildInfo.layer_ids() its configs use

    def item(self, s: Sample) -> dict[str, torch.Tensor]:
        """Exactly what the trainer's own dataset yields for this sample."""
        ...

    def sample_paths(self, index: int, sample_id: str) -> list[str]:
        """Export: the relative path of the one file a sample has at row `index` (a row's path is the same on
        every run: the export moves a file when its sample's row changes)."""
        ...

    def sample_files(self, s: Sample) -> dict[str, bytes]:
        """Export: {its `sample_paths` path: file bytes}, one file a sample. The bytes never depend on `s.index`:
        a file renumbered by a later export is moved, never written again."""
        ...

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,
                     draft_vocab_size: int | None) -> dict[str, bytes | Callable[[Path], None]]:
        """Export: the files written once every sample is out (dataset index, token frequencies, vocab map),
        in order; a callable value writes a big file itself (to the temp path it is given)."""
        ...

    def scan(self, root: Path) -> list[Path]:
        """Import: the dump's sample files."""
        ...

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Import: a file's token ids (and loss mask, if it keeps one), cheaply; raises Rejected."""
        ...

    def load(self, path: Path) -> Loaded:
        """Import: read and check one file; raises Rejected(reason, message)."""
        ...
