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

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from builder.errors import SourceError
from builder.extract import arrow_source, chat
from builder.extract.chat import CONVERSATION_FIELDS, ConversationError
from builder.layout import BuildLayout
from builder.log.events import EventLog, open_log

JSON_SUFFIXES = {".jsonl", ".json", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}

# a chat.Tokenizer (`encode` for text rows, `chat` for conversation rows), or a plain `text -> ids` function,
# which takes text rows only
Tokenizer = chat.Tokenizer | Callable[[str], list[int]]
INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


@dataclass
class Sample:
    sample_id: str
    row: int
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]
    fingerprint: str

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def fingerprint(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def load_source(path: str | Path, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                build: BuildLayout | None = None) -> list[Sample]:
    """Load and validate every sample of a source file. Raises SourceError naming file, line and field.

    With `vocab_size` (init), a sample without tokens or with a token id outside 0..vocab_size-1 is refused
    too. With `build` (a run, holding the build's lock), the same check runs against the vocabulary the build
    recorded, except for samples registered in the build exactly as they are (same id, same tokens): a build
    made before init checked this still runs, and its workers record those samples `failed` as before."""
    if build is not None:
        with open_log(build.events, read_only=True) as log:
            recorded = log.meta().get("vocab_size")
            return _load(Path(path), tokenizer, None if recorded is None else int(recorded), _Registered(log))
    return _load(Path(path), tokenizer, vocab_size, None)


class _Registered:
    """Is (sample id, fingerprint) registered in the build? Asked only about samples the model cannot take."""

    def __init__(self, log: EventLog):
        self.log = log

    def __call__(self, sample_id: str, fp: str) -> bool:
        rows = self.log.query("SELECT 1 FROM samples WHERE sample_id = ? AND fingerprint = ? LIMIT 1",
                              [sample_id, fp])[1]
        return bool(rows)


def _load(path: Path, tokenizer: Tokenizer | None, vocab_size: int | None,
          registered: Callable[[str, str], bool] | None) -> list[Sample]:
    if not path.exists():
        raise SourceError(path, "file not found; pass an existing .jsonl or .parquet file with --source")
    if path.is_dir():
        if not arrow_source.is_dataset_dir(path):
            arrow_source.refuse_other_dir(path)
        return _samples_from_table(path, "arrow", arrow_source.read_dataset_dir(path), {}, tokenizer, vocab_size,
                                   registered)
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        kind = "json"
    elif suffix in PARQUET_SUFFIXES:
        kind = "parquet"
    else:
        raise SourceError(path, f"unknown source type '{suffix}'; use a .jsonl or .parquet file, or a `datasets` "
                                "save_to_disk directory")
    table, types = _read_with_duckdb(path, kind)
    return _samples_from_table(path, kind, table, types, tokenizer, vocab_size, registered)


def _read_with_duckdb(path: Path, kind: str) -> tuple[pa.Table, dict[str, str]]:
    con = duckdb.connect()
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
        fetch = getattr(rel, "to_arrow_table", None) or rel.arrow  # duckdb 2.x / 1.x
        return fetch(), {c: str(t) for c, t in zip(rel.columns, rel.types, strict=True)}
    except SourceError:
        raise
    except duckdb.Error as e:
        if kind == "json":
            _scan_json_lines(path)  # raises a precise SourceError if it finds the bad line
        raise SourceError(path, f"cannot be read: {str(e).splitlines()[0]}") from e
    finally:
        con.close()


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


def _samples_from_table(path: Path, kind: str, table: pa.Table, types: dict[str, str], tokenizer: Tokenizer | None,
                        vocab_size: int | None = None,
                        registered: Callable[[str, str], bool] | None = None) -> list[Sample]:
    names = set(table.column_names)
    lines = _json_line_numbers(path) if kind == "json" else None
    where = "line" if kind == "json" else "row"

    def fail(row: int, field: str, msg: str) -> SourceError:
        if kind == "json":
            return SourceError(path, msg, line=_row_label(kind, row, lines), field=field)
        if kind == "arrow":  # rows counted from 0, as the sample ids (and speculators' hs_{i} files) count
            return SourceError(path, f"{msg} (row index {row})", field=field)
        return SourceError(path, f"{msg} (row {row + 1})", field=field)

    if table.num_rows == 0:
        raise SourceError(path, "has no rows")
    if not names & {"input_ids", "text", *CONVERSATION_FIELDS}:
        raise SourceError(path, f"has none of 'input_ids', 'messages', 'conversations' or 'text' (columns: "
                                f"{sorted(names)})", field="input_ids")

    n = table.num_rows

    def list_column(name: str, ok_value, what: str) -> list[np.ndarray | None]:
        """A list column as per-row numpy views (None for a missing value); a wrong type names the line."""
        if name not in names:
            return [None] * n
        col = table.column(name).combine_chunks()
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        if is_list and pa.types.is_decimal(col.type.value_type) and col.type.value_type.scale == 0:
            # DuckDB types a JSON list column decimal when a value does not fit int64 (or signs mix with
            # uint64-sized values); the per-row check below names the row of a value outside int32
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
        offsets = col.offsets.to_numpy()
        if col.values.null_count:  # [1, null, 3]: a null inside a row's list
            pos = int(np.flatnonzero(col.values.is_null().to_numpy(zero_copy_only=False))[0])
            row = int(np.searchsorted(offsets, pos, side="right")) - 1
            raise fail(row, name, f"holds null at position {pos - int(offsets[row])}; give {what} only")
        values = col.values.to_numpy(zero_copy_only=False)
        nulls = col.is_null().to_numpy(zero_copy_only=False)
        return [None if nulls[i] else values[offsets[i] : offsets[i + 1]] for i in range(n)]

    # a dataset directory's sample i is row i, whatever its columns: speculators names its files hs_{i}
    raw_ids = _id_column(path, kind, table, types, fail) if "id" in names and kind != "arrow" else None

    ids_list = list_column("input_ids", pa.types.is_integer, "integers")
    masks = list_column("loss_mask", lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t), "0/1 integers")
    texts = table.column("text").to_pylist() if "text" in names else [None] * n
    seq_lens = table.column("seq_len").to_pylist() if kind == "arrow" and "seq_len" in names else None
    convs = _conversation_rows(path, kind, table, names)
    tok = chat.as_tokenizer(tokenizer)

    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for i in range(n):
        ids = ids_list[i]
        mask = masks[i]
        tokens_field = "input_ids"
        if ids is None and convs is not None and any(convs[i].get(c) is not None for c in CONVERSATION_FIELDS):
            ids, mask, tokens_field = _tokenize_conversation(i, convs[i], masks[i] is not None, tok, fail)
        elif ids is None:
            text = texts[i]
            if text is None:
                raise fail(i, "input_ids", MISSING)
            if not isinstance(text, str):
                raise fail(i, "text", "must be a string")
            if tok is None:
                raise fail(i, "text", "needs a tokenizer, but the model has none")
            ids = np.asarray(tok.encode(text), dtype=np.int64)
            tokens_field = "text"
        ids = np.asarray(ids)
        if seq_lens is not None and seq_lens[i] is not None and seq_lens[i] != ids.shape[0]:
            raise fail(i, "seq_len", f"is {seq_lens[i]} but input_ids has {ids.shape[0]} tokens")
        if ids.size and (ids.min() < INT32_MIN or ids.max() > INT32_MAX):
            raise fail(i, tokens_field, "holds a value outside the 32-bit integer range")
        ids32 = ids.astype(np.int32)
        unusable = _unusable(ids32, vocab_size) if vocab_size is not None or registered is not None else None
        if unusable and registered is None:
            raise fail(i, tokens_field, unusable)
        if mask is None:
            mask8 = np.ones(ids32.shape[0], dtype=np.uint8)
        else:
            mask = np.asarray(mask)
            if mask.shape[0] != ids32.shape[0]:
                raise fail(i, "loss_mask", f"has {mask.shape[0]} entries but input_ids has {ids32.shape[0]}")
            if mask.size and (mask.min() < 0 or mask.max() > 1):
                raise fail(i, "loss_mask", "must hold only 0 and 1")
            mask8 = mask.astype(np.uint8)
        if raw_ids is not None and raw_ids[i] is not None:
            sid = str(raw_ids[i])
        else:
            sid = str(i)
        if sid in seen:
            raise fail(i, "id", f"duplicate id '{sid}' (first seen at {where} {_row_label(kind, seen[sid], lines)})")
        seen[sid] = i
        fp = fingerprint(ids32, mask8)
        if unusable and not registered(sid, fp):
            raise fail(i, tokens_field, unusable)
        samples.append(Sample(sid, i, ids32, mask8, fp))
    return samples


def _unusable(ids: np.ndarray, vocab_size: int | None) -> str | None:
    """Why the model cannot take these tokens (no tokens, an id outside its vocabulary), or None."""
    if not ids.size:
        return "has no tokens; a sample needs at least one (drop the row)"
    if vocab_size is not None:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            return f"token id {int(bad[0])} is outside the model's vocabulary 0..{vocab_size - 1}"
    return None


def _conversation_rows(path: Path, kind: str, table: pa.Table, names: set[str]) -> list[dict] | None:
    """Per row, its conversation fields as Python values; None when the source has no conversation column.

    A JSONL file's come from its own lines: DuckDB unifies the messages of all rows into one struct type (or
    JSON text), while the line says exactly what the row holds (a missing key, a number for a string)."""
    present = [c for c in CONVERSATION_FIELDS if c in names]
    if not present:
        return None
    if kind == "json":
        return [{c: obj.get(c) for c in present} if isinstance(obj, dict) else {}
                for _, obj in _iter_json_lines(path)]
    cols = {c: table.column(c).to_pylist() for c in present}
    return [{c: cols[c][i] for c in present} for i in range(table.num_rows)]


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
