"""What a trainer format is: one class (`TrainerFormat`) in one module, registered by name (formats/registry.py).

Its class attributes say what the rest of hsbuild shows and checks without an instance (and without torch: a
format module is imported by the CLI and by `init`): its name, its trainer, its files, what it is for (export,
import), its final state and layer numbering, the trainer's default aux layers and the flag that names others,
the options it takes, and its row of the table in docs/design.md. Its methods are the trainer's conventions:
what the trainer's dataset yields for a sample (`item`), the file an export writes for it (`sample_path`,
`sample_bytes`) and at the end (`finish_files`), and, for import, where a dump keeps each sample (`scan`) and
what one file holds (`tokens`, `load`).

A format never touches the build: the export/import drivers read and write it, with checksums, atomic files and
the event log. A format module only knows its trainer's conventions (layout, keys, dtypes, shapes, layer
numbering, final state before or after the norm), each checked against the trainer's own code.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, ClassVar, Protocol

if TYPE_CHECKING:  # (torch: imported by the methods that make or read a tensor, never by importing a format)
    import torch


def files_under(root: Path, keep: Callable[[str], bool]) -> list[Path]:
    """The files under `root` whose name `keep` takes: what `sorted(p for p in root.rglob("*") if p.is_file() and
    keep(p.name))` gives (links to files taken, linked folders not entered, an unreadable folder skipped), walked
    with os.scandir: no stat of a file that is not a link, no Path made before the end (an export's layout scans
    OUT after writing a file for every sample)."""
    found: list[str] = []
    stack = [os.fspath(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except PermissionError:
            continue
        with it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif keep(e.name) and e.is_file():
                    found.append(e.path)
    found.sort(key=lambda path: path.split(os.sep))  # (Path's own order: part by part)
    return [Path(path) for path in found]


@dataclass
class Streamed:
    """A sample file too big to make in memory first (`TrainerFormat.sample_bytes`): `write(f)` writes its bytes
    to `f` (a binary file object: `write` and `flush` only), at most `size` bytes (what the export's watermarks
    count before it is written). The same bytes as in memory, without their copy there."""

    size: int
    write: Callable[[BinaryIO], None]


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


@dataclass
class SourceRow:
    """A build sample's row of the source as it is now (`BuildView.source_rows`): `kind` "conversation", "tokens"
    or "text"; for a conversation, its messages (OpenAI form, as `init` read them) and the fingerprint of its
    tokens as `init` makes them (the build's fingerprint when the row is unchanged). `problem`: why the row
    cannot be read or tokenized now (then `fingerprint` is None)."""

    sample_id: str
    row: int
    kind: str
    messages: list[dict] | None = None
    fingerprint: str | None = None
    problem: str | None = None


class BuildView(Protocol):
    """What export lends a format that needs more of the build than a sample's arrays (`TrainerFormat.prepare`);
    each part is read only when asked for."""

    def meta(self) -> dict:
        """The build's metadata, as `init` recorded it."""
        ...

    def source_rows(self, sample_ids: Iterable[str]) -> tuple[bool, dict[str, SourceRow]]:
        """Whether the build's source holds any conversation, and these samples' rows in it now (a sample whose
        id is no longer in the source is absent). SourceError when the source cannot be read."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Token ids as text with the build's tokenizer, special tokens skipped."""
        ...

    def written(self, sample_ids: Iterable[str]) -> dict[str, dict]:
        """The detail of each sample's `written` event (the one its stored states are from)."""
        ...


@dataclass(frozen=True)
class DocRow:
    """A format's row of the trainer-format table in docs/design.md (section 13), in Markdown, column by column
    (`registry.docs_table` writes the table; a test keeps the document equal to it)."""

    trainer: str  # the trainer, the version its conventions were checked against, and the code they come from
    files: str  # what `hsbuild export` writes (or an import reads) for a sample
    tensors: str  # what one sample's file holds
    numbering: str  # how its aux layer ids count (and its default layers)
    final_state: str  # before or after the final norm
    yields: str  # what its dataset yields for a sample
    vocab: str  # its token frequencies and reduced draft vocabulary files


class TrainerFormat:
    """One trainer's file format. Subclasses set the class attributes and implement the methods of what they
    are for: `exports` (item, sample_path, sample_bytes, finish_files) and `imports` (scan, tokens, load)."""

    # -- read without an instance (the registry, the CLI, `init`, the docs table) -----------------------------
    name: ClassVar[str]  # `--format NAME`, `HiddenStateDataset(format=NAME)`
    summary: ClassVar[str]  # its files and who writes them, one phrase (`hsbuild export/import --help`)
    doc: ClassVar[DocRow]
    exports: ClassVar[bool] = True  # `hsbuild export` writes it, HiddenStateDataset(format=) yields its items
    # its files hold hidden states (a trainer's format: `init` lists it among the trainers a build feeds,
    # HiddenStateDataset(format=) yields its items). False: text from the stored tokens and loss mask only (the
    # export reads no states; no final state or layer numbering is asked of the build)
    states: ClassVar[bool] = True
    imports: ClassVar[bool] = True  # `hsbuild import` reads its dumps
    final_state: str = "post_norm"  # the final state its files and items hold: "post_norm" or "pre_norm"
    # what every file of its dumps holds, as its trainer's tools write them: an import of a "post_norm" dump into
    # a build that stores pre_norm is refused before anything is read (the norm cannot be undone). None: its
    # files say, or `--dump-final-state` does (checked file by file)
    dump_final_state: ClassVar[str | None] = None
    layer_convention: ClassVar[str]  # the numbering its configs use: a key of formats.numbering.NUMBERINGS
    # the options it takes besides the build: name (an export flag or a dataset keyword) -> what it does, for
    # --help; make_format refuses any other option given
    options: ClassVar[Mapping[str, str]] = {}

    def __init__(self, **options: object):
        """An instance with `options` (keys of `options`; the others keep their class defaults)."""
        for key, value in options.items():
            if key not in self.options:
                raise TypeError(f"{type(self).__name__}: no option {key!r} (it takes {', '.join(self.options)})")
            setattr(self, key, value)

    @classmethod
    def default_layers(cls, num_layers: int) -> list[int] | None:
        """The aux layers its trainer takes when none are named, for a `num_layers`-layer target, in its own
        numbering; None: its trainer needs no flag (nothing to tell it)."""
        return None

    @classmethod
    def layer_flag(cls, ids: list[int]) -> str:
        """What tells its trainer to take the aux layers `ids` (its own numbering): a flag or a config key."""
        raise NotImplementedError(f"{cls.name}: names no layer flag")

    # -- export (and HiddenStateDataset(format=)) -----------------------------------------------------------
    def prepare(self, build: BuildView, samples: list[dict]) -> dict[str, Rejected]:
        """Called once by export, before anything is written, with the build and its live selected samples (the
        `samples` view's sample_id, row_idx, fingerprint, source_tokens, num_tokens...): the samples this format
        cannot export (id -> Rejected(reason, message)), left out and named in the report as a damaged sample
        is. Raise FormatError to refuse the whole export (nothing written). `sample_bytes` may also raise
        Rejected for one sample. Default: every sample can be exported."""
        return {}

    def item(self, s: Sample) -> dict[str, torch.Tensor]:
        """Exactly what the trainer's own dataset yields for this sample."""
        raise NotImplementedError(f"{self.name}: an import-only format")

    def sample_path(self, index: int, sample_id: str) -> str:
        """The relative path of the one file the sample at export row `index` has (a row's path is the same on
        every run: the export moves a file when its sample's row changes)."""
        raise NotImplementedError(f"{self.name}: an import-only format")

    def sample_bytes(self, s: Sample) -> bytes | Streamed:
        """The bytes of the sample's file (at `sample_path(s.index, s.sample_id)`), or for a big one a `Streamed`
        that writes them to the file. They never depend on `s.index`: a file renumbered by a later export is
        moved, never written again."""
        raise NotImplementedError(f"{self.name}: an import-only format")

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,
                     draft_vocab_size: int | None) -> dict[str, bytes | Callable[[Path], None]]:
        """The dataset-wide files written once every sample is out (dataset index, token frequencies over
        loss-masked tokens `freq`, vocab mapping), in order; a callable value writes a big file itself (to the
        temp path it is given). `rows` streams the exported rows in order (read once, at most)."""
        raise NotImplementedError(f"{self.name}: an import-only format")

    # -- import ---------------------------------------------------------------------------------------------
    def scan(self, root: Path) -> list[Path]:
        """The dump's sample files (an export also removes any such file it does not vouch for)."""
        raise NotImplementedError(f"{self.name}: reads no dumps")

    def tokens(self, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A file's token ids (and loss mask, if it keeps one), cheaply; raises Rejected."""
        raise NotImplementedError(f"{self.name}: reads no dumps")

    def load(self, path: Path) -> Loaded:
        """Read and check one file; raises Rejected(reason, message)."""
        raise NotImplementedError(f"{self.name}: reads no dumps")

    def named_sample(self, path: Path) -> str | int | None:
        """The sample a dump file's name points at, where this format names files by sample: its id (str) or
        its source row (int); the import report shows it for a file it cannot use. None: names say nothing."""
        return None
