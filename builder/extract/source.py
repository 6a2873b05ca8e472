"""Reading the sample source: JSONL or Parquet through DuckDB, one sample a row; or a `datasets` save_to_disk
directory (speculators' preprocessed data) through pyarrow (extract/arrow_source.py).

A row has `input_ids` (list of ints) with optional `loss_mask` (same length) and optional `id`; or a
conversation, `messages` (OpenAI) or `conversations` (ShareGPT), tokenized with the model's chat template, its
loss mask 1 on the assistant's tokens (extract/chat.py); or `text`, tokenized with the model's tokenizer.
`input_ids` win over a conversation, a conversation over `text`. A sample's identity is its id (default: the row
number; in a dataset directory always the row number) plus a fingerprint of its tokens and loss mask.

DuckDB reads the bulk; when DuckDB rejects the file or types a column wrongly, a line-by-line Python scan
finds the exact line and field for the error message.

Here: one reader per kind of source (JSONL, Parquet, a dataset directory), each giving batches of rows; the rows
of a batch are checked and held by extract/source_checks.py, each kind of row's rule is in
extract/source_rows.py, the line-by-line JSONL scan in extract/source_jsonl.py and the tokens held as they are
read (spilled to temporary files beyond a bound) in extract/source_buffers.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from builder.errors import SourceError
from builder.extract import arrow_source, chat
from builder.extract.samples import Sample, SourceSamples, fingerprint  # noqa: F401 (Sample, fingerprint: re-exported)
from builder.extract.source_buffers import TokenBuffers
from builder.extract.source_checks import failer, first_duplicate, sample_ids, samples_from_table
from builder.extract.source_jsonl import JsonRows, scan_json_lines
from builder.extract.source_rows import Check, Fail, RowError
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log

JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}

# a chat.Tokenizer (`encode` for text rows, `chat` for conversation rows), or a plain `text -> ids` function,
# which takes text rows only
Tokenizer = chat.Tokenizer | Callable[[str], list[int]]
# A source is read and checked in batches of rows: only one batch's Arrow table is in memory at a time. Tokens and
# masks (5 bytes a token) stay in memory up to SPILL_BYTES; beyond that they go to two unlinked temporary files
# (in TMPDIR) that are mapped at the end, so what a large source holds in memory is about 60 bytes a row plus
# its ids' characters, and its tokens are pages of a file (read back as samples are dispatched).
BATCH_ROWS = 8192
SPILL_BYTES = 64 << 20


def load_source(path: str | Path, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                build: BuildLayout | None = None, batch_rows: int = BATCH_ROWS,
                spill_bytes: int = SPILL_BYTES, regenerate: str | None = None) -> SourceSamples:
    """Load and validate every sample of a source file. Raises SourceError naming file, line and field.
    The samples are held columnar (extract/samples.py): a Sample is made when one is indexed.

    With `vocab_size` (init), a sample without tokens or with a token id outside 0..vocab_size-1 is refused
    too. With `build` (a run, holding the build's lock), the same check runs against the vocabulary the build
    recorded, except for samples registered in the build exactly as they are (same id, same tokens): a build
    made before init checked this still runs, and its workers record those samples `failed` as before.

    The file is read `batch_rows` rows at a time; tokens beyond `spill_bytes` are kept in a temporary file (see
    SPILL_BYTES). Errors are the same as a whole-file pass gives: the first bad row's first failing check.

    `regenerate` (a regenerating build's --turns, `all` or `last`): every row must be a conversation; a sample's
    tokens are the first prompt it is generated after, its loss mask zeros, and it carries its messages
    (Sample.conversation; extract/prompts.py)."""
    buffers = TokenBuffers(spill_bytes)
    try:
        if build is not None:
            with open_log(build.events, read_only=True) as log:
                recorded = log.meta().get("vocab_size")
                return _load(Path(path), tokenizer, None if recorded is None else int(recorded), _Registered(log),
                             batch_rows, buffers, regenerate)
        return _load(Path(path), tokenizer, vocab_size, None, batch_rows, buffers, regenerate)
    finally:
        buffers.close()
        # Arrow's allocator keeps what it freed: hand it back to the OS
        pa.default_memory_pool().release_unused()


class _Registered:
    """Is (sample id, fingerprint) registered in the build? Asked only about samples the model cannot take."""

    def __init__(self, log: EventLog):
        self.log = log

    def __call__(self, sample_id: str, fp: str) -> bool:
        rows = self.log.query("SELECT 1 FROM samples WHERE sample_id = ? AND fingerprint = ? LIMIT 1",
                              [sample_id, fp])[1]
        return bool(rows)


def _load(path: Path, tokenizer: Tokenizer | None, vocab_size: int | None,
          registered: Callable[[str, str], bool] | None, batch_rows: int, buffers: TokenBuffers,
          regenerate: str | None = None) -> SourceSamples:
    with contextlib.ExitStack() as stack:
        kind, types, batches = open_batches(path, batch_rows, stack)
        return _load_batches(path, kind, batches, types, tokenizer, vocab_size, registered, buffers, regenerate)


def open_batches(path: Path, batch_rows: int,
          stack: contextlib.ExitStack) -> tuple[str, dict[str, str], Iterable[pa.Table]]:
    """The source's kind ('json', 'parquet', 'arrow'), its column types and its batches of rows."""
    if not path.exists():
        raise SourceError(path, "file not found; pass an existing .jsonl or .parquet file with --source")
    if path.is_dir():
        return "arrow", {}, _dataset_dir_batches(path, batch_rows)
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json", *_jsonl_batches(stack.enter_context(duckdb.connect()), path, batch_rows)
    if suffix in PARQUET_SUFFIXES:
        return "parquet", *_parquet_batches(stack.enter_context(duckdb.connect()), path, batch_rows)
    raise SourceError(path, f"unknown source type '{suffix}'; use a .jsonl or .parquet file, or a `datasets` "
                            "save_to_disk directory")


def _dataset_dir_batches(path: Path, batch_rows: int) -> Iterator[pa.Table]:
    """A `datasets` save_to_disk directory (extract/arrow_source.py): memory-mapped files, sliced, not copied."""
    if not arrow_source.is_dataset_dir(path):
        arrow_source.refuse_other_dir(path)
    table = arrow_source.read_dataset_dir(path)
    return (table.slice(a, batch_rows) for a in range(0, table.num_rows, batch_rows))


def _jsonl_batches(con: duckdb.DuckDBPyConnection, path: Path,
                   batch_rows: int) -> tuple[dict[str, str], Iterator[pa.Table]]:
    """A JSONL file, one JSON object a line, through DuckDB (its types over the whole file)."""
    if path.stat().st_size == 0:
        raise SourceError(path, "file is empty; it needs one JSON object a line")
    return _duckdb_batches(con, path, "json", "SELECT * FROM read_json($p, format='newline_delimited', "
                           "records=true, sample_size=-1, maximum_object_size=1073741824)", batch_rows)


def _parquet_batches(con: duckdb.DuckDBPyConnection, path: Path,
                     batch_rows: int) -> tuple[dict[str, str], Iterator[pa.Table]]:
    """A Parquet file, through DuckDB."""
    return _duckdb_batches(con, path, "parquet", "SELECT * FROM read_parquet($p)", batch_rows)


def _duckdb_batches(con: duckdb.DuckDBPyConnection, path: Path, kind: str, sql: str,
                    batch_rows: int) -> tuple[dict[str, str], Iterator[pa.Table]]:
    """The file's column types (DuckDB's, over the whole file) and its rows as tables of `batch_rows` rows."""
    try:
        rel = con.sql(sql, params={"p": str(path)})
        types = {c: str(t) for c, t in zip(rel.columns, rel.types, strict=True)}
        reader = (getattr(rel, "to_arrow_reader", None) or rel.fetch_arrow_reader)(batch_rows)  # duckdb 2.x / 1.x
    except duckdb.Error as e:
        _unreadable(path, kind, e)

    def batches() -> Iterator[pa.Table]:
        try:
            for b in reader:
                yield pa.Table.from_batches([b])
        except duckdb.Error as e:  # met while reading on
            _unreadable(path, kind, e)

    return types, batches()


def _unreadable(path: Path, kind: str, e: duckdb.Error) -> None:
    if kind == "json":
        scan_json_lines(path)  # raises a precise SourceError if it finds the bad line
    raise SourceError(path, f"cannot be read: {str(e).splitlines()[0]}") from e


def _load_batches(path: Path, kind: str, batches: Iterable[pa.Table], types: dict[str, str],
                  tokenizer: Tokenizer | None, vocab_size: int | None, registered: Callable[[str, str], bool] | None,
                  buffers: TokenBuffers, regenerate: str | None = None) -> SourceSamples:
    """Check and hold the batches one after the other (their tables are dropped as they are done). An id seen
    in an earlier batch is a duplicate as in a whole-file pass: reported when its row comes before the first
    other error."""
    fail, label = failer(path, kind)
    json_rows = JsonRows(path) if kind == "json" else None
    ids: list[pa.Array] = []  # per batch: its sample ids, fingerprints, rows, token counts (its tokens: buffers)
    fps: list[pa.Array] = []
    rows: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    convs: list[pa.Array] = []  # a regenerating build's conversations, per batch
    row0 = 0
    for table in batches:
        n = table.num_rows
        if n == 0:
            continue
        try:
            part = samples_from_table(path, kind, table, types, tokenizer, vocab_size, registered, row0=row0,
                                      json_rows=json_rows, failer_=(fail, label), regenerate=regenerate)
        except RowError as e:
            if ids:  # an id of an earlier batch seen again before this error's row?
                dup = first_duplicate(ids + [_batch_ids(path, kind, table, types, fail, row0)
                                             .slice(0, e.row - row0 + 1)], fail, label, kind)
                if dup is not None and (dup.row, dup.check) < (e.row, e.check):
                    raise dup from None
            raise
        buffers.add(part.tokens, part.mask, part.starts)
        ids.append(part._ids)
        fps.append(part._fps)
        rows.append(part.rows)
        lens.append(part.num_tokens)
        if part.conversations is not None:
            convs.append(part.conversations)
        del part, table
        row0 += n
        pa.default_memory_pool().release_unused()
    if not ids:
        raise SourceError(path, "has no rows")
    if len(ids) > 1:
        dup = first_duplicate(ids, fail, label, kind)
        if dup is not None:
            raise dup
    tokens, mask, starts = buffers.finish()
    return SourceSamples(pa.concat_arrays(ids), pa.concat_arrays(fps), np.concatenate(rows), starts,
                         np.concatenate(lens), tokens, mask, pa.concat_arrays(convs) if convs else None)




def _batch_ids(path: Path, kind: str, table: pa.Table, types: dict[str, str], fail: Fail,
               row0: int) -> pa.StringArray:
    """The sample ids of a batch whose first row is row0 of the file."""

    def fail_here(i: int, field: str, msg: str, check: Check = Check.FIELDS) -> RowError:
        return fail(row0 + i, field, msg, check)

    return sample_ids(path, kind, table, types, fail_here, row0)
