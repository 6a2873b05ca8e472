"""`hsbuild import BUILD DIR --format F`: which dump file holds which sample of the build's source.

Files are matched to samples by their token ids, not by their names: SpecForge numbers its files in a shuffled
order, a home-grown script by whatever it liked, and a file whose tokens are not a source row's is no sample of
this build whatever its name says. A file's ids must equal the sample's ids as the build stores them (the
source row, cut to --max-tokens); a SpecForge file may carry trailing (token 0, mask 0) batch padding, which is
tried off. Samples with equal tokens share a file (their states are the same). Files whose tokens cannot be
read, or match no sample, are listed with the reason; they are never modified.

The run itself is an ordinary run (`run.coordinator`) with the import backend (`extract.backends.dump`): each
matched file is checked in full by a worker before its states are written, with checksums, in durable groups,
its `written` event naming the file (`detail.import`). Samples without a usable file stay for `resume`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import numpy as np

from builder.errors import FormatError, UsageError
from builder.extract.final_norm import FINAL_STATES
from builder.extract.source import Sample
from builder.trainers import IMPORT_FORMATS, make_format
from builder.trainers.base import Rejected


@dataclass
class ImportOptions:
    dir: str
    format: str
    final_state: str = "post_norm"  # `pt` files that do not say: is their final state after the norm or before
    jobs: int = 8  # threads reading token ids while matching


@dataclass(frozen=True)
class FileProblem:
    path: str
    reason: str  # truncated, unreadable, bad_keys, bad_shape, token_mismatch, duplicate
    message: str
    sample_id: str | None = None  # when the file's name says which sample it was meant for


@dataclass
class DumpIndex:
    files: dict[str, str] = field(default_factory=dict)  # sample id -> dump file
    problems: list[FileProblem] = field(default_factory=list)
    scanned: int = 0

    def summary(self) -> dict:
        return {"scanned": self.scanned, "matched_samples": len(self.files), "problems": len(self.problems)}


def check_options(opts: ImportOptions) -> Path:
    if opts.format not in IMPORT_FORMATS:
        raise UsageError(f"--format {opts.format}: use one of {', '.join(IMPORT_FORMATS)}")
    if opts.final_state not in FINAL_STATES:
        raise UsageError(f"--final-state {opts.final_state}: use one of {', '.join(FINAL_STATES)}")
    root = Path(opts.dir).absolute()
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory; give the folder of the dump to import")
    return root


def _key(ids: np.ndarray) -> tuple[int, bytes]:
    a = np.ascontiguousarray(ids, dtype=np.int64)
    return int(a.shape[0]), hashlib.blake2b(a.tobytes(), digest_size=16).digest()


def index_dump(opts: ImportOptions, samples: Iterable[Sample], max_tokens: int | None) -> DumpIndex:
    """Read every file's token ids (in threads) and match them to the source's samples."""
    root = check_options(opts)
    fmt = make_format(opts.format, final_state=opts.final_state)
    paths = fmt.scan(root)
    if not paths:
        raise FormatError(f"{root}: no {opts.format} files found (see `hsbuild import --help` for what each format's "
                          "files are called)")
    by_key: dict[tuple[int, bytes], list[str]] = {}
    by_row: dict[int, str] = {}
    ids_of: set[str] = set()
    for s in samples:
        ids = s.input_ids[:max_tokens] if max_tokens else s.input_ids
        by_key.setdefault(_key(ids), []).append(s.sample_id)
        by_row[s.row] = s.sample_id
        ids_of.add(s.sample_id)

    def read(p: Path):
        try:
            return fmt.tokens(p)
        except Rejected as e:
            return e
        except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's problem
            return Rejected("unreadable", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    out = DumpIndex(scanned=len(paths))
    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        for p, got in zip(paths, pool.map(read, paths), strict=True):
            if isinstance(got, Rejected):
                out.problems.append(FileProblem(str(p), got.reason, str(got), _hint(opts.format, p, by_row, ids_of)))
                continue
            ids, mask = got
            matched = _match(ids.numpy(), None if mask is None else mask.numpy(), by_key)
            if not matched:
                out.problems.append(FileProblem(str(p), "token_mismatch",
                                                f"its {ids.shape[0]} token ids are no source row of the build",
                                                _hint(opts.format, p, by_row, ids_of)))
                continue
            new = [sid for sid in matched if sid not in out.files]
            if not new:
                out.problems.append(FileProblem(str(p), "duplicate", f"holds the same tokens as "
                                                                     f"{out.files[matched[0]]}", matched[0]))
                continue
            for sid in new:
                out.files[sid] = str(p)
    return out


def _match(ids: np.ndarray, mask: np.ndarray | None, by_key: dict) -> list[str]:
    hit = by_key.get(_key(ids))
    if hit:
        return hit
    # SpecForge right-pads a file to its batch's longest row with token 0 and mask 0: try the tail off
    nz = np.flatnonzero(ids != 0) if mask is None else np.flatnonzero((ids != 0) | (mask != 0))
    last = int(nz[-1]) + 1 if nz.size else 0
    for n in range(ids.shape[0] - 1, max(last, 1) - 1, -1):
        hit = by_key.get(_key(ids[:n]))
        if hit:
            return hit
    return []


def _hint(fmt: str, path: Path, by_row: dict[int, str], ids: set[str]) -> str | None:
    """The sample a file's name points at, where its format names files by sample (for the report only)."""
    stem = path.name.split(".")[0]
    if fmt == "modelopt" or fmt == "pt":
        sid = unquote(stem)
        return sid if sid in ids else None
    if fmt == "speculators" and stem.startswith("hs_") and stem[3:].isdigit():
        return by_row.get(int(stem[3:]))
    return None
