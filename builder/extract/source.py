"""Reading the sample source: JSONL or Parquet through DuckDB, one sample a row; or a `datasets` save_to_disk
directory (speculators' preprocessed data) through pyarrow (extract/arrow_source.py).

A row has `input_ids` (list of ints) with optional `loss_mask` (same length) and optional `id`; or a
conversation, `messages` (OpenAI) or `conversations` (ShareGPT), tokenized with the model's chat template, its
loss mask 1 on the assistant's tokens (extract/chat.py); or `text`, tokenized with the model's tokenizer.
`input_ids` win over a conversation, a conversation over `text`. A sample's identity is its id (default: the row
number; in a dataset directory always the row number) plus a fingerprint of its tokens and loss mask.

DuckDB reads the bulk; when DuckDB rejects the file or types a column wrongly, a line-by-line Python scan
finds the exact line and field for the error message.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from builder.errors import SourceError
from builder.extract import arrow_source, chat
from builder.extract.chat import CONVERSATION_FIELDS, ConversationError
from builder.extract.samples import Sample, SourceSamples, fingerprint, fingerprints  # noqa: F401 (Sample: re-exported)
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log

JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}

# a chat.Tokenizer (`encode` for text rows, `chat` for conversation rows), or a plain `text -> ids` function,
# which takes text rows only
Tokenizer = chat.Tokenizer | Callable[[str], list[int]]
INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
NARROW_INTS = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16)}  # fit int32
# A source is read and checked in batches of rows: only one batch's Arrow table is in memory at a time. Tokens and
# masks (5 bytes a token) stay in memory up to SPILL_BYTES; beyond that they go to two unlinked temporary files
# (in TMPDIR) that are mapped at the end, so what a large source holds in memory is about 60 bytes a row plus
# its ids' characters, and its tokens are pages of a file (read back as samples are dispatched).
BATCH_ROWS = 8192
SPILL_BYTES = 64 << 20


def load_source(path: str | Path, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                build: BuildLayout | None = None, batch_rows: int = BATCH_ROWS,
                spill_bytes: int = SPILL_BYTES) -> SourceSamples:
    """Load and validate every sample of a source file. Raises SourceError naming file, line and field.
    The samples are held columnar (extract/samples.py): a Sample is made when one is indexed.

    With `vocab_size` (init), a sample without tokens or with a token id outside 0..vocab_size-1 is refused
    too. With `build` (a run, holding the build's lock), the same check runs against the vocabulary the build
    recorded, except for samples registered in the build exactly as they are (same id, same tokens): a build
    made before init checked this still runs, and its workers record those samples `failed` as before.

    The file is read `batch_rows` rows at a time; tokens beyond `spill_bytes` are kept in a temporary file (see
    SPILL_BYTES). Errors are the same as a whole-file pass gives: the first bad row's first failing check."""
    buffers = _Buffers(spill_bytes)
    try:
        if build is not None:
            with open_log(build.events, read_only=True) as log:
                recorded = log.meta().get("vocab_size")
                return _load(Path(path), tokenizer, None if recorded is None else int(recorded), _Registered(log),
                             batch_rows, buffers)
        return _load(Path(path), tokenizer, vocab_size, None, batch_rows, buffers)
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
          registered: Callable[[str, str], bool] | None, batch_rows: int, buffers: _Buffers) -> SourceSamples:
    if not path.exists():
        raise SourceError(path, "file not found; pass an existing .jsonl or .parquet file with --source")
    if path.is_dir():
        if not arrow_source.is_dataset_dir(path):
            arrow_source.refuse_other_dir(path)
        kind, table = "arrow", arrow_source.read_dataset_dir(path)  # memory-mapped files: sliced, not copied
        types: dict[str, str] = {}
        batches: Iterable[pa.Table] = (table.slice(a, batch_rows) for a in range(0, table.num_rows, batch_rows))
        return _load_batches(path, kind, batches, types, tokenizer, vocab_size, registered, buffers)
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        kind = "json"
    elif suffix in PARQUET_SUFFIXES:
        kind = "parquet"
    else:
        raise SourceError(path, f"unknown source type '{suffix}'; use a .jsonl or .parquet file, or a `datasets` "
                                "save_to_disk directory")
    con = duckdb.connect()
    try:
        types, batches = _read_with_duckdb(con, path, kind, batch_rows)
        return _load_batches(path, kind, batches, types, tokenizer, vocab_size, registered, buffers)
    finally:
        con.close()


def _load_batches(path: Path, kind: str, batches: Iterable[pa.Table], types: dict[str, str],
                  tokenizer: Tokenizer | None, vocab_size: int | None, registered: Callable[[str, str], bool] | None,
                  buffers: _Buffers) -> SourceSamples:
    """Check and hold the batches one after the other (their tables are dropped as they are done). An id seen
    in an earlier batch is a duplicate as in a whole-file pass: reported when its row comes before the first
    other error."""
    fail, label = _failer(path, kind)
    json_rows = _JsonRows(path) if kind == "json" else None
    ids: list[pa.Array] = []  # per batch: its sample ids, fingerprints, rows, token counts (its tokens: buffers)
    fps: list[pa.Array] = []
    rows: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    row0 = 0
    for table in batches:
        n = table.num_rows
        if n == 0:
            continue
        try:
            part = _samples_from_table(path, kind, table, types, tokenizer, vocab_size, registered, row0=row0,
                                       json_rows=json_rows, failer=(fail, label))
        except SourceError as e:
            at = getattr(e, "row", None)
            if at is not None and ids:  # an id of an earlier batch seen again before this error's row?
                dup = _first_duplicate(ids + [_batch_ids(path, kind, table, types, fail, row0)
                                              .slice(0, at - row0 + 1)], fail, label, kind)
                if dup is not None and (dup.row, 6) < (at, getattr(e, "order", 0)):  # type: ignore[attr-defined]
                    raise dup from None
            raise
        buffers.add(part.tokens, part.mask, part.starts)
        ids.append(part._ids)
        fps.append(part._fps)
        rows.append(part.rows)
        lens.append(part.num_tokens)
        del part, table
        row0 += n
        pa.default_memory_pool().release_unused()
    if not ids:
        raise SourceError(path, "has no rows")
    if len(ids) > 1:
        dup = _first_duplicate(ids, fail, label, kind)
        if dup is not None:
            raise dup
    tokens, mask, starts = buffers.finish()
    return SourceSamples(pa.concat_arrays(ids), pa.concat_arrays(fps), np.concatenate(rows), starts,
                         np.concatenate(lens), tokens, mask)


def _batch_ids(path: Path, kind: str, table: pa.Table, types: dict[str, str],
               fail: Callable[[int, str, str], SourceError], row0: int) -> pa.StringArray:
    """The sample ids of a batch whose first row is row0 of the file."""
    if "id" not in table.column_names or kind == "arrow":
        return _row_numbers(table.num_rows, row0)
    return _sample_ids(path, kind, table, types, lambda i, f, m: fail(row0 + i, f, m), row0)


class _Buffers:
    """Every sample's tokens (int32) and mask (uint8), batch after batch: in memory up to `spill_bytes`, then
    in two unlinked temporary files (TMPDIR), mapped copy-on-write by `finish`. Nothing is left on disk: the
    files have no name and go with the mapping. Where TMPDIR cannot take them (full, missing) everything stays
    in memory, as before spilling existed."""

    def __init__(self, spill_bytes: int):
        self.spill_bytes = spill_bytes
        self.tokens: list[np.ndarray] = []  # parts not in the files
        self.masks: list[np.ndarray] = []
        self.starts: list[np.ndarray] = []
        self.count = 0  # tokens so far
        self.spilled = 0  # tokens in the files
        self.files: tuple | None = None
        self.memory_only = False

    def add(self, tokens: np.ndarray, mask: np.ndarray, starts: np.ndarray) -> None:
        self.starts.append(starts + self.count)
        self.tokens.append(np.ascontiguousarray(tokens, dtype=np.int32))
        self.masks.append(np.ascontiguousarray(mask, dtype=np.uint8))
        self.count += tokens.shape[0]
        if self.files is None and not self.memory_only and self.count * 5 > self.spill_bytes:
            try:
                self.files = (tempfile.TemporaryFile(prefix="hsbuild-source-tokens-", buffering=0),
                              tempfile.TemporaryFile(prefix="hsbuild-source-mask-", buffering=0))
            except OSError:
                self.memory_only = True
        if self.files is not None:
            self._spill()

    def _spill(self) -> None:
        assert self.files is not None
        try:
            while self.tokens:
                for f, a in zip(self.files, (self.tokens[0], self.masks[0]), strict=True):
                    view = memoryview(a).cast("B")
                    while view:
                        view = view[f.write(view):]
                self.spilled += self.tokens.pop(0).shape[0]
                self.masks.pop(0)
        except OSError:  # TMPDIR is full: read back what is there, hold everything in memory from now on
            back = []
            for f, dtype in zip(self.files, (np.int32, np.uint8), strict=True):
                f.seek(0)
                back.append(np.fromfile(f, dtype=dtype, count=self.spilled))
            self.tokens.insert(0, back[0])
            self.masks.insert(0, back[1])
            self.spilled = 0
            self.close()
            self.memory_only = True

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)
        if self.files is None:
            return _joined(self.tokens, np.int32), _joined(self.masks, np.uint8), starts
        # copy-on-write: writable arrays for torch, never written back
        tokens = np.memmap(self.files[0], dtype=np.int32, mode="c", shape=(self.count,))
        mask = np.memmap(self.files[1], dtype=np.uint8, mode="c", shape=(self.count,))
        return tokens, mask, starts

    def close(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.close()  # a mapping made by finish keeps its file until it is gone
            self.files = None


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _failer(path: Path, kind: str) -> tuple[Callable[[int, str, str], SourceError], Callable[[int], int]]:
    """fail(row, field, message) -> the SourceError naming that row of the file (0-based over the whole file,
    kept on the error as `row`), and label(row) -> its line (JSONL) or row number."""
    line_cache: list[list[int]] = []

    def label(row: int) -> int:
        if kind == "json" and not line_cache:  # read only when an error names a line
            line_cache.append(_json_line_numbers(path))
        return _row_label(kind, row, line_cache[0] if line_cache else None)

    def fail(row: int, field: str, msg: str) -> SourceError:
        if kind == "json":
            err = SourceError(path, msg, line=label(row), field=field)
        elif kind == "arrow":  # rows counted from 0, as the sample ids (and speculators' hs_{i} files) count
            err = SourceError(path, f"{msg} (row index {row})", field=field)
        else:
            err = SourceError(path, f"{msg} (row {row + 1})", field=field)
        err.row = row  # type: ignore[attr-defined]
        return err

    return fail, label


def _first_duplicate(ids: list[pa.Array], fail: Callable[[int, str, str], SourceError], label: Callable[[int], int],
                     kind: str, row0: int = 0) -> SourceError | None:
    """The error for the first id (over these arrays, in order, their first row being row0 of the file) seen
    before, or None."""
    every = pa.concat_arrays(ids)
    codes = every.dictionary_encode().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    if not codes.size or int(codes.max()) + 1 == codes.size:  # codes number the ids in order of first appearance
        return None
    seen_before = np.empty_like(codes)
    seen_before[0] = -1
    np.maximum.accumulate(codes[:-1], out=seen_before[1:])
    r = int(np.flatnonzero(codes <= seen_before)[0])
    first = int(np.argmax(codes == codes[r]))
    where = "line" if kind == "json" else "row"
    err = fail(row0 + r, "id", f"duplicate id '{every[r].as_py()}' (first seen at {where} {label(row0 + first)})")
    err.order = 6  # type: ignore[attr-defined]
    return err


def _read_with_duckdb(con: duckdb.DuckDBPyConnection, path: Path, kind: str,
                      batch_rows: int) -> tuple[dict[str, str], Iterator[pa.Table]]:
    """The file's column types (DuckDB's, over the whole file) and its rows as tables of `batch_rows` rows."""
    try:
        if kind == "json":
            if path.stat().st_size == 0:
                raise SourceError(path, "file is empty; it needs one JSON object a line")
            rel = con.sql(
                "SELECT * FROM read_json($p, format='newline_delimited', records=true, sample_size=-1,"
                " maximum_object_size=1073741824)",
                params={"p": str(path)},
            )
        else:
            rel = con.sql("SELECT * FROM read_parquet($p)", params={"p": str(path)})
        types = {c: str(t) for c, t in zip(rel.columns, rel.types, strict=True)}
        reader = (getattr(rel, "to_arrow_reader", None) or rel.fetch_arrow_reader)(batch_rows)  # duckdb 2.x / 1.x
    except SourceError:
        raise
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
        _scan_json_lines(path)  # raises a precise SourceError if it finds the bad line
    raise SourceError(path, f"cannot be read: {str(e).splitlines()[0]}") from e


def _iter_json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) per non-blank line; lines end at '\n' only, as DuckDB and
    `_json_line_numbers` count them. Raises UnicodeDecodeError at the first line that is not UTF-8."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():  # blank, as _json_line_numbers and DuckDB see it
                continue
            line = raw.decode("utf-8").rstrip("\r\n")
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(path, f"malformed JSON: {_json_problem(e)}", line=lineno) from None


def _json_problem(e: json.JSONDecodeError) -> str:
    """json's own message and column within the line: 'Expecting ',' delimiter at column 20'. (The line
    number is the row's: a row is one line.)"""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"  # json's 'Invalid control character at'


def _scan_json_lines(path: Path) -> None:
    """Find the first bad line of a JSONL file and raise SourceError for it."""
    try:
        for lineno, obj in _iter_json_lines(path):
            _check_record(path, lineno, obj)
    except UnicodeDecodeError:
        _raise_non_utf8(path)


def _raise_non_utf8(path: Path) -> None:
    """Name the first line (and field) that is not UTF-8."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                field = None
                try:
                    obj = json.loads(raw.decode("utf-8", errors="surrogateescape"))
                    if isinstance(obj, dict):
                        field = next((k for k, v in obj.items() if _has_surrogate(k) or _has_surrogate(v)), None)
                except json.JSONDecodeError:
                    pass
                raise SourceError(path, f"not UTF-8 text ({e.reason} at byte {e.start})", line=lineno,
                                  field=field) from None
    raise SourceError(path, "not UTF-8 text")


def _has_surrogate(v: object) -> bool:
    if isinstance(v, str):
        return any("\udc80" <= c <= "\udcff" for c in v)
    if isinstance(v, list):
        return any(_has_surrogate(x) for x in v)
    if isinstance(v, dict):
        return any(_has_surrogate(k) or _has_surrogate(x) for k, x in v.items())
    return False


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_record(path: Path, line: int, obj: object) -> None:
    if not isinstance(obj, dict):
        raise SourceError(path, f"expected a JSON object, got {type(obj).__name__}", line=line)
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(_is_int(x) for x in ids):
            raise SourceError(path, "must be a list of integers", line=line, field="input_ids")
        if any(not INT32_MIN <= x <= INT32_MAX for x in ids):
            raise SourceError(path, "holds a value outside the 32-bit integer range", line=line, field="input_ids")
        mask = obj.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or not all(isinstance(x, int | bool) for x in mask):
                raise SourceError(path, "must be a list of 0/1 integers", line=line, field="loss_mask")
            if len(mask) != len(ids):
                raise SourceError(
                    path, f"has {len(mask)} entries but input_ids has {len(ids)}", line=line, field="loss_mask"
                )
    elif any(obj.get(c) is not None for c in CONVERSATION_FIELDS):
        try:
            _conversation(obj)
        except _FieldError as e:
            raise SourceError(path, e.message, line=line, field=e.field) from None
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise SourceError(path, "must be a string", line=line, field="text")
    else:
        raise SourceError(path, MISSING, line=line, field="input_ids")
    if obj.get("id") is not None and not (isinstance(obj["id"], str) or _is_int(obj["id"])):
        raise SourceError(path, f"must be a string or an integer, not {json.dumps(obj['id'])}", line=line,
                          field="id")


MISSING = "missing; each row needs 'input_ids' (list of ints), 'messages', 'conversations' or 'text'"


class _FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


def _conversation(obj: dict) -> tuple[str, list[dict]]:
    """The conversation field of a row without input_ids and its messages, normalized (extract/chat.py)."""
    given = [c for c in CONVERSATION_FIELDS if obj.get(c) is not None]
    if len(given) > 1:
        raise _FieldError(given[1], "a row holds 'messages' or 'conversations', not both")
    column = given[0]
    if obj.get("loss_mask") is not None:
        raise _FieldError("loss_mask", f"a '{column}' row's loss mask comes from the chat template (its assistant "
                                       "tokens); drop 'loss_mask', or give 'input_ids' with it")
    try:
        return column, chat.normalize(column, obj[column])
    except ConversationError as e:
        raise _FieldError(chat.field_name(column, e.index, e.key), e.message) from None


ID_TYPES = ("VARCHAR", "BIGINT", "INTEGER", "SMALLINT", "TINYINT", "UBIGINT", "UINTEGER", "USMALLINT", "UTINYINT",
            "HUGEINT", "UHUGEINT", '"NULL"', "NULL")


def _id_column(path: Path, kind: str, table: pa.Table, types: dict[str, str],
               fail: Callable[[int, str, str], SourceError]) -> list:
    """The `id` column as Python values (str or int, or None); anything else names its line (row)."""
    values = table.column("id").to_pylist()
    if types.get("id") == "JSON":  # ids of mixed types (strings and numbers): DuckDB hands back JSON text
        values = [None if v is None else json.loads(v) for v in values]
    elif types.get("id") not in ID_TYPES and kind == "json":
        _scan_json_lines(path)  # a DOUBLE column holds 1 and 1.5 alike: the file says which line is wrong
    for i, v in enumerate(values):
        if v is not None and not (isinstance(v, str) or _is_int(v)):
            raise fail(i, "id", f"must be a string or an integer, not {json.dumps(v, default=str)}")
    return values


def _row_label(kind: str, row: int, lines: list[int] | None) -> int:
    if kind == "json" and lines is not None:
        return lines[row]
    return row + 1


def _json_line_numbers(path: Path) -> list[int]:
    out = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                out.append(lineno)
    return out


class _ListColumn:
    """A list column of the table: its values (numpy), offsets [n+1] and per-row nulls."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray, nulls: np.ndarray):
        self.values, self.offsets, self.nulls = values, offsets, nulls
        self.lengths = np.where(nulls, 0, np.diff(offsets))

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def rows_with_values(self, bad: np.ndarray) -> np.ndarray:
        """The rows (sorted, unique, not null) holding the value positions where `bad` is true."""
        pos = np.flatnonzero(bad)
        if not pos.size:
            return pos
        rows = np.unique(np.searchsorted(self.offsets, pos, side="right") - 1)
        rows = rows[(rows >= 0) & (rows < self.nulls.shape[0])]  # values no row refers to: none of its business
        return rows[~self.nulls[rows]]


def _first(rows: np.ndarray, before: int) -> int | None:
    """The first of these row numbers below `before` (rows need not be sorted)."""
    rows = rows[rows < before]
    return int(rows.min()) if rows.size else None


def _copy_rows(dst: np.ndarray, dst_off: np.ndarray, src: np.ndarray, src_off: np.ndarray, rows: np.ndarray) -> None:
    """dst's range of each row = src's range of that row (same lengths), one copy per run of consecutive rows
    (a source of token lists only is one copy)."""
    if not rows.size:
        return
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    for a, b in zip(rows[np.r_[0, cut]].tolist(), rows[np.r_[cut - 1, rows.size - 1]].tolist(), strict=True):
        d0, d1 = int(dst_off[a]), int(dst_off[b + 1])
        s0 = int(src_off[a])
        dst[d0:d1] = src[s0 : s0 + (d1 - d0)]


def _samples_from_table(path: Path, kind: str, table: pa.Table, types: dict[str, str], tokenizer: Tokenizer | None,
                        vocab_size: int | None = None, registered: Callable[[str, str], bool] | None = None,
                        row0: int = 0, json_rows: _JsonRows | None = None,
                        failer: tuple[Callable[[int, str, str], SourceError], Callable[[int], int]] | None = None,
                        ) -> SourceSamples:
    """Validate the table's rows (rows row0.. of the file) and hold them columnar. Checks run column by column
    (numpy), except for rows to tokenize; the error raised is the one the first bad row's first failing check
    gives, as a row-by-row pass would find it (its `row` and `order` kept on it)."""
    names = set(table.column_names)
    gfail, glabel = failer or _failer(path, kind)

    def label(row: int) -> int:
        return glabel(row0 + row)

    def fail(row: int, field: str, msg: str) -> SourceError:
        return gfail(row0 + row, field, msg)

    if table.num_rows == 0:
        raise SourceError(path, "has no rows")
    if not names & {"input_ids", "text", *CONVERSATION_FIELDS}:
        raise SourceError(path, f"has none of 'input_ids', 'messages', 'conversations' or 'text' (columns: "
                                f"{sorted(names)})", field="input_ids")

    n = table.num_rows

    def list_column(name: str, ok_value, what: str) -> _ListColumn | None:
        """A list column's values, offsets and nulls (None when absent); a wrong type names the line."""
        if name not in names:
            return None
        col = table.column(name).combine_chunks()
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        if is_list and pa.types.is_decimal(col.type.value_type) and col.type.value_type.scale == 0:
            # DuckDB types a JSON list column decimal when a value does not fit int64 (or signs mix with
            # uint64-sized values); the range check below names the row of a value outside int32
            try:
                col = col.cast(pa.list_(pa.int64()))
            except pa.ArrowInvalid:
                if kind == "json":
                    _scan_json_lines(path)
        if is_list and len(col.values) == 0:  # only empty lists: DuckDB cannot tell their type
            col = col.cast(pa.list_(pa.int64()))
        if not is_list or not ok_value(col.type.value_type):
            if kind == "json":
                _scan_json_lines(path)
            first = next((i for i, v in enumerate(col.is_null().to_pylist()) if not v), 0)
            raise fail(first, name, f"must be a list of {what} (column type is {col.type})")
        offsets = col.offsets.to_numpy().astype(np.int64)
        if col.values.null_count:  # [1, null, 3]: a null inside a row's list
            pos = int(np.flatnonzero(col.values.is_null().to_numpy(zero_copy_only=False))[0])
            row = int(np.searchsorted(offsets, pos, side="right")) - 1
            raise fail(row, name, f"holds null at position {pos - int(offsets[row])}; give {what} only")
        return _ListColumn(col.values.to_numpy(zero_copy_only=False), offsets,
                           col.is_null().to_numpy(zero_copy_only=False))

    # a dataset directory's sample i is row i, whatever its columns: speculators names its files hs_{i}
    sids = _sample_ids(path, kind, table, types, fail, row0) if "id" in names and kind != "arrow" \
        else _row_numbers(n, row0)

    ids_col = list_column("input_ids", pa.types.is_integer, "integers")
    mask_col = list_column("loss_mask", lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t), "0/1 integers")
    tok = chat.as_tokenizer(tokenizer)
    ids_null = ids_col.nulls if ids_col is not None else np.ones(n, dtype=bool)
    mask_null = mask_col.nulls if mask_col is not None else np.ones(n, dtype=bool)

    # candidate errors (row, order of the check within a row, error): the least is raised
    errors: list[tuple[int, int, SourceError]] = []
    # rows without input_ids: tokenized here (their text, or their conversation with the chat template)
    tokenized: dict[int, tuple[np.ndarray, np.ndarray | None, str]] = {}  # row -> (ids, mask or None, field)
    m = n  # rows from m on are not looked at: row m could not be tokenized
    todo = np.flatnonzero(ids_null)
    if todo.size:
        texts = table.column("text") if "text" in names else None
        convs = _conversation_rows(path, kind, table, names, row0, json_rows)
        for i in todo.tolist():
            try:
                if convs is not None and any(convs[i].get(c) is not None for c in CONVERSATION_FIELDS):
                    tokenized[i] = _tokenize_conversation(i, convs[i], not mask_null[i], tok, fail)
                    continue
                text = texts[i].as_py() if texts is not None else None
                if text is None:
                    raise fail(i, "input_ids", MISSING)
                if not isinstance(text, str):
                    raise fail(i, "text", "must be a string")
                if tok is None:
                    raise fail(i, "text", "needs a tokenizer, but the model has none")
                tokenized[i] = (np.asarray(tok.encode(text), dtype=np.int64), None, "text")
            except SourceError as e:
                errors.append((i, 0, e))
                m = i
                break
        del convs

    def field_of(i: int) -> str:
        return tokenized[i][2] if i in tokenized else "input_ids"

    def row_ids(i: int) -> np.ndarray:
        return tokenized[i][0] if i in tokenized else ids_col.row(i)

    def row_mask(i: int) -> np.ndarray | None:
        if i in tokenized and tokenized[i][1] is not None:
            return tokenized[i][1]
        return None if mask_null[i] else mask_col.row(i)

    lens = ids_col.lengths.copy() if ids_col is not None else np.zeros(n, dtype=np.int64)
    for i, (ids, _, _) in tokenized.items():
        lens[i] = ids.shape[0]
    tok_rows = np.fromiter(tokenized, dtype=np.int64, count=len(tokenized))

    # a dataset directory's `seq_len` column says how many tokens a row has
    if kind == "arrow" and "seq_len" in names:
        seq = table.column("seq_len").combine_chunks()
        seq_null = seq.is_null().to_numpy(zero_copy_only=False)
        seq_val = seq.fill_null(0).to_numpy(zero_copy_only=False)
        r = _first(np.flatnonzero(~seq_null & (seq_val != lens)), m)
        if r is not None:
            errors.append((r, 1, fail(r, "seq_len", f"is {seq_val[r]} but input_ids has {lens[r]} tokens")))

    # token ids in the 32-bit range
    out_of_range = [i for i in tok_rows.tolist()
                    if tokenized[i][0].size and (tokenized[i][0].min() < INT32_MIN or tokenized[i][0].max() > INT32_MAX)]
    if ids_col is not None and ids_col.values.dtype not in NARROW_INTS:
        v = ids_col.values
        out_of_range += ids_col.rows_with_values((v < INT32_MIN) | (v > INT32_MAX)).tolist()
    r = _first(np.asarray(out_of_range, dtype=np.int64), m)
    if r is not None:
        errors.append((r, 2, fail(r, field_of(r), "holds a value outside the 32-bit integer range")))

    # tokens the model cannot take: none, or an id outside its vocabulary
    checked = vocab_size is not None or registered is not None
    unusable = np.flatnonzero(lens[:m] == 0) if checked else np.zeros(0, dtype=np.int64)
    if vocab_size is not None:
        oov = [i for i in tok_rows.tolist() if i < m and _unusable(tokenized[i][0], vocab_size)]
        if ids_col is not None:
            v = ids_col.values
            oov += ids_col.rows_with_values((v < 0) | (v >= vocab_size)).tolist()
        unusable = np.union1d(unusable, np.asarray(oov, dtype=np.int64))
    unusable = unusable[unusable < m]
    if registered is None and unusable.size:
        r = int(unusable[0])
        errors.append((r, 3, fail(r, field_of(r), _unusable(row_ids(r).astype(np.int32), vocab_size))))

    # the loss mask: as long as the tokens, 0 and 1 only
    if mask_col is not None:
        r = _first(np.flatnonzero(~mask_null & (mask_col.lengths != lens)), m)
        if r is not None:
            errors.append((r, 4, fail(r, "loss_mask", f"has {mask_col.lengths[r]} entries but input_ids has "
                                                      f"{lens[r]}")))
        v = mask_col.values
        bad = mask_col.rows_with_values((v < 0) | (v > 1)) if v.dtype != np.bool_ else np.zeros(0, np.int64)
        r = _first(bad, m)
        if r is not None:
            errors.append((r, 5, fail(r, "loss_mask", "must hold only 0 and 1")))
    conv_masks = [i for i in tok_rows.tolist() if i < m and tokenized[i][1] is not None and tokenized[i][1].size
                  and (tokenized[i][1].min() < 0 or tokenized[i][1].max() > 1)]
    if conv_masks:
        errors.append((conv_masks[0], 5, fail(conv_masks[0], "loss_mask", "must hold only 0 and 1")))

    # ids: each once
    dup = _first_duplicate([sids.slice(0, m)], gfail, glabel, kind, row0)
    if dup is not None:
        errors.append((dup.row - row0, 6, dup))  # type: ignore[attr-defined]

    # a build's run: unusable rows are refused unless registered exactly as they are (same id, same tokens)
    stop = min(errors, key=lambda e: e[:2])[0] if errors else m
    if registered is not None:
        for r in unusable[unusable < stop].tolist():
            ids32 = row_ids(r).astype(np.int32)
            mask = row_mask(r)
            mask8 = np.ones(ids32.shape[0], np.uint8) if mask is None else np.asarray(mask).astype(np.uint8)
            if not registered(sids[r].as_py(), fingerprint(ids32, mask8)):
                errors.append((r, 7, fail(r, field_of(r), _unusable(ids32, vocab_size))))
                break
    if errors:
        _, order, err = min(errors, key=lambda e: e[:2])
        err.order = order  # type: ignore[attr-defined]
        raise err

    # hold them: two flat buffers
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    tokens = np.empty(total, dtype=np.int32)
    if ids_col is not None:
        _copy_rows(tokens, offsets, ids_col.values, ids_col.offsets, np.flatnonzero(~ids_null))
    mask8 = np.ones(total, dtype=np.uint8)
    if mask_col is not None:
        _copy_rows(mask8, offsets, mask_col.values, mask_col.offsets, np.flatnonzero(~mask_null))
    for i, (ids, mask, _) in tokenized.items():
        tokens[offsets[i] : offsets[i + 1]] = ids
        if mask is not None:
            mask8[offsets[i] : offsets[i + 1]] = mask
    starts = offsets[:-1]
    return SourceSamples(sids, fingerprints(tokens, mask8, starts, lens), np.arange(row0, row0 + n, dtype=np.int64),
                         starts, lens, tokens, mask8)


def _row_numbers(n: int, row0: int = 0) -> pa.StringArray:
    return pa.array(np.arange(row0, row0 + n, dtype=np.int64)).cast(pa.string())


def _sample_ids(path: Path, kind: str, table: pa.Table, types: dict[str, str],
                fail: Callable[[int, str, str], SourceError], row0: int = 0) -> pa.StringArray:
    """Each row's sample id: its `id` (a string, or an integer written in decimal), else its row number."""
    n = table.num_rows
    col = table.column("id").combine_chunks()
    t = col.type
    if types.get("id", "VARCHAR") in ID_TYPES and (pa.types.is_string(t) or pa.types.is_large_string(t)
                                                   or pa.types.is_integer(t) or pa.types.is_null(t)):
        ids = col.cast(pa.string())  # in Arrow: no Python object a row
    else:
        values = _id_column(path, kind, table, types, fail)
        ids = pa.array([None if v is None else str(v) for v in values], pa.string())
    if ids.null_count:
        ids = pc.if_else(ids.is_null(), _row_numbers(n, row0), ids)
    return ids


def _unusable(ids: np.ndarray, vocab_size: int | None) -> str | None:
    """Why the model cannot take these tokens (no tokens, an id outside its vocabulary), or None."""
    if not ids.size:
        return "has no tokens; a sample needs at least one (drop the row)"
    if vocab_size is not None:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            return f"token id {int(bad[0])} is outside the model's vocabulary 0..{vocab_size - 1}"
    return None


def _conversation_rows(path: Path, kind: str, table: pa.Table, names: set[str], row0: int = 0,
                       json_rows: _JsonRows | None = None) -> list[dict] | None:
    """Per row, its conversation fields as Python values; None when the source has no conversation column.

    A JSONL file's come from its own lines: DuckDB unifies the messages of all rows into one struct type (or
    JSON text), while the line says exactly what the row holds (a missing key, a number for a string)."""
    present = [c for c in CONVERSATION_FIELDS if c in names]
    if not present:
        return None
    if kind == "json":
        objs = (json_rows or _JsonRows(path)).rows(row0, table.num_rows)
        return [{c: obj.get(c) for c in present} if isinstance(obj, dict) else {} for obj in objs]
    cols = {c: table.column(c).to_pylist() for c in present}
    return [{c: cols[c][i] for c in present} for i in range(table.num_rows)]


class _JsonRows:
    """A JSONL file's rows (parsed lines, blank lines skipped) read forward: `rows(row0, n)` for batches that
    come in order, each line parsed once."""

    def __init__(self, path: Path):
        self._lines_path = path
        self._lines = _iter_json_lines(path)
        self._next = 0  # the row _lines yields next

    def rows(self, row0: int, n: int) -> list[object]:
        if row0 < self._next:  # asked again for rows already passed: start over
            self._lines, self._next = _iter_json_lines(self._lines_path), 0
        skip = row0 - self._next
        out = [obj for _, obj in itertools.islice(self._lines, skip, skip + n)]
        self._next = row0 + len(out)
        return out


def _tokenize_conversation(i: int, row: dict, has_mask: bool, tok, fail) -> tuple[np.ndarray, np.ndarray, str]:
    """(input_ids, loss_mask, field) of a conversation row with the model's chat template."""
    try:
        column, messages = _conversation({**row, "loss_mask": 1 if has_mask else None})
    except _FieldError as e:
        raise fail(i, e.field, e.message) from None
    if tok is None:
        raise fail(i, column, "needs a tokenizer with a chat template, but the model has none (--model HF_DIR)")
    try:
        ids, mask = tok.chat(messages)
    except ConversationError as e:
        raise fail(i, chat.field_name(column, e.index, e.key), e.message) from None
    ids_arr = np.asarray(ids, dtype=np.int64)
    mask_arr = np.asarray(mask, dtype=np.int64)
    if mask_arr.shape != ids_arr.shape:  # a tokenizer's bug, not the row's: still name the row
        raise fail(i, column, f"the chat template gave {ids_arr.shape[0]} tokens but a mask of {mask_arr.shape[0]}")
    return ids_arr, mask_arr, column
