"""A batch of source rows checked and held columnar (`samples_from_table`).

The checks run column by column (numpy) over the whole batch, except for the rows to tokenize (text,
conversations: extract/source_rows.py), and each finds its first bad row. The error raised is the one a
row-by-row pass would meet first: the first bad row's, and of that row's, the first failing check's (the order of
`source_rows.Check`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from builder.errors import SourceError
from builder.extract import chat
from builder.extract.chat import CONVERSATION_FIELDS
from builder.extract.samples import SourceSamples, fingerprint, fingerprints, with_conversations
from builder.extract.source_jsonl import JsonRows, json_line_numbers, scan_json_lines
from builder.extract.source_rows import (
    INT32_MAX,
    INT32_MIN,
    NOT_A_CONVERSATION,
    Check,
    Fail,
    RowError,
    out_of_int32,
    prompt_of_conversation,
    tokenize_conversation,
    tokenize_text,
    unusable,
)

NARROW_INTS = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16)}  # fit int32
ID_TYPES = ("VARCHAR", "BIGINT", "INTEGER", "SMALLINT", "TINYINT", "UBIGINT", "UINTEGER", "USMALLINT", "UTINYINT",
            "HUGEINT", "UHUGEINT", '"NULL"', "NULL")
Label = Callable[[int], int]


def failer(path: Path, kind: str) -> tuple[Fail, Label]:
    """fail(row, field, message[, check]) -> the RowError naming that row of the file (0-based over the whole
    file), and label(row) -> its line (JSONL) or row number."""
    line_cache: list[list[int]] = []

    def label(row: int) -> int:
        if kind == "json" and not line_cache:  # read only when an error names a line
            line_cache.append(json_line_numbers(path))
        if kind == "json" and line_cache:
            return line_cache[0][row]
        return row + 1

    def fail(row: int, field: str, msg: str, check: Check = Check.FIELDS) -> RowError:
        if kind == "json":
            return RowError(path, msg, line=label(row), field=field, row=row, check=check)
        if kind == "arrow":  # rows counted from 0, as the sample ids (and speculators' hs_{i} files) count
            return RowError(path, f"{msg} (row index {row})", field=field, row=row, check=check)
        return RowError(path, f"{msg} (row {row + 1})", field=field, row=row, check=check)

    return fail, label


def first_duplicate(ids: list[pa.Array], fail: Fail, label: Label, kind: str, row0: int = 0) -> RowError | None:
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
    return fail(row0 + r, "id", f"duplicate id '{every[r].as_py()}' (first seen at {where} {label(row0 + first)})",
                Check.UNIQUE_ID)


# -- sample ids ----------------------------------------------------------------------------------------------


def row_numbers(n: int, row0: int = 0) -> pa.StringArray:
    return pa.array(np.arange(row0, row0 + n, dtype=np.int64)).cast(pa.string())


def sample_ids(path: Path, kind: str, table: pa.Table, types: dict[str, str], fail: Fail,
               row0: int = 0) -> pa.StringArray:
    """Each row's sample id: its `id` (a string, or an integer written in decimal), else its row number. A
    dataset directory's sample i is row i, whatever its columns (speculators names its files hs_{i})."""
    n = table.num_rows
    if "id" not in table.column_names or kind == "arrow":
        return row_numbers(n, row0)
    col = table.column("id").combine_chunks()
    t = col.type
    if types.get("id", "VARCHAR") in ID_TYPES and (pa.types.is_string(t) or pa.types.is_large_string(t)
                                                   or pa.types.is_integer(t) or pa.types.is_null(t)):
        ids = col.cast(pa.string())  # in Arrow: no Python object a row
    else:
        values = _id_values(path, kind, table, types, fail)
        ids = pa.array([None if v is None else str(v) for v in values], pa.string())
    if ids.null_count:
        ids = pc.if_else(ids.is_null(), row_numbers(n, row0), ids)
    return ids


def _id_values(path: Path, kind: str, table: pa.Table, types: dict[str, str], fail: Fail) -> list:
    """The `id` column as Python values (str or int, or None); anything else names its line (row)."""
    values = table.column("id").to_pylist()
    if types.get("id") == "JSON":  # ids of mixed types (strings and numbers): DuckDB hands back JSON text
        values = [None if v is None else json.loads(v) for v in values]
    elif types.get("id") not in ID_TYPES and kind == "json":
        scan_json_lines(path)  # a DOUBLE column holds 1 and 1.5 alike: the file says which line is wrong
    for i, v in enumerate(values):
        if v is not None and not (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))):
            raise fail(i, "id", f"must be a string or an integer, not {json.dumps(v, default=str)}")
    return values


# -- the batch's rows --------------------------------------------------------------------------------------------


class ListColumn:
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


def list_column(path: Path, kind: str, table: pa.Table, name: str, ok_value: Callable[[pa.DataType], bool],
                what: str, fail: Fail) -> ListColumn | None:
    """A list column's values, offsets and nulls (None when absent); a wrong type names the line."""
    if name not in table.column_names:
        return None
    col = table.column(name).combine_chunks()
    is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
    if is_list and pa.types.is_decimal(col.type.value_type) and col.type.value_type.scale == 0:
        # DuckDB types a JSON list column decimal when a value does not fit int64 (or signs mix with
        # uint64-sized values); the range check names the row of a value outside int32
        try:
            col = col.cast(pa.list_(pa.int64()))
        except pa.ArrowInvalid:
            if kind == "json":
                scan_json_lines(path)
    if is_list and len(col.values) == 0:  # only empty lists: DuckDB cannot tell their type
        col = col.cast(pa.list_(pa.int64()))
    if not is_list or not ok_value(col.type.value_type):
        if kind == "json":
            scan_json_lines(path)
        first = next((i for i, v in enumerate(col.is_null().to_pylist()) if not v), 0)
        raise fail(first, name, f"must be a list of {what} (column type is {col.type})")
    offsets = col.offsets.to_numpy().astype(np.int64)
    if col.values.null_count:  # [1, null, 3]: a null inside a row's list
        pos = int(np.flatnonzero(col.values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, pos, side="right")) - 1
        raise fail(row, name, f"holds null at position {pos - int(offsets[row])}; give {what} only")
    return ListColumn(col.values.to_numpy(zero_copy_only=False), offsets,
                      col.is_null().to_numpy(zero_copy_only=False))


class Rows:
    """A batch's rows: tokens rows from the `input_ids` column (and `loss_mask`), the others as tokenized."""

    def __init__(self, n: int, ids: ListColumn | None, mask: ListColumn | None):
        self.n, self.ids, self.mask = n, ids, mask
        self.ids_null = ids.nulls if ids is not None else np.ones(n, dtype=bool)
        self.mask_null = mask.nulls if mask is not None else np.ones(n, dtype=bool)
        self.tokenized: dict[int, tuple[np.ndarray, np.ndarray | None, str]] = {}  # row -> (ids, mask, field)
        self.conversations: dict[int, str] | None = None  # a regenerating build: row -> its messages (JSON)
        self.lens = np.zeros(n, dtype=np.int64)
        self.tok_rows = np.zeros(0, dtype=np.int64)

    def count_tokens(self) -> None:
        """Once tokenized: each row's tokens."""
        self.lens = self.ids.lengths.copy() if self.ids is not None else np.zeros(self.n, dtype=np.int64)
        for i, (ids, _, _) in self.tokenized.items():
            self.lens[i] = ids.shape[0]
        self.tok_rows = np.fromiter(self.tokenized, dtype=np.int64, count=len(self.tokenized))

    def field_of(self, i: int) -> str:
        return self.tokenized[i][2] if i in self.tokenized else "input_ids"

    def row_ids(self, i: int) -> np.ndarray:
        return self.tokenized[i][0] if i in self.tokenized else self.ids.row(i)

    def row_mask(self, i: int) -> np.ndarray | None:
        if i in self.tokenized and self.tokenized[i][1] is not None:
            return self.tokenized[i][1]
        return None if self.mask_null[i] else self.mask.row(i)

    def token_lists(self, below: int) -> list[tuple[int, np.ndarray]]:
        """(row, ids) of the tokenized rows below `below`."""
        return [(i, self.tokenized[i][0]) for i in self.tok_rows.tolist() if i < below]


def conversation_rows(path: Path, kind: str, table: pa.Table, row0: int = 0,
                      json_rows: JsonRows | None = None) -> list[dict] | None:
    """Per row, its conversation fields as Python values; None when the source has no conversation column.

    A JSONL file's come from its own lines: DuckDB unifies the messages of all rows into one struct type (or
    JSON text), while the line says exactly what the row holds (a missing key, a number for a string)."""
    present = [c for c in CONVERSATION_FIELDS if c in table.column_names]
    if not present:
        return None
    if kind == "json":
        objs = (json_rows or JsonRows(path)).rows(row0, table.num_rows)
        return [{c: obj.get(c) for c in present} if isinstance(obj, dict) else {} for obj in objs]
    cols = {c: table.column(c).to_pylist() for c in present}
    return [{c: cols[c][i] for c in present} for i in range(table.num_rows)]


# -- the checks, in the order of Check ---------------------------------------------------------------------------


def samples_from_table(path: Path, kind: str, table: pa.Table, types: dict[str, str],
                       tokenizer: chat.Tokenizer | Callable[[str], list[int]] | None, vocab_size: int | None = None,
                       registered: Callable[[str, str], bool] | None = None, row0: int = 0,
                       json_rows: JsonRows | None = None, failer_: tuple[Fail, Label] | None = None,
                       regenerate: str | None = None) -> SourceSamples:
    """Validate the table's rows (rows row0.. of the file) and hold them columnar. Raises the RowError a
    row-by-row pass would meet first (see the module's docstring); `registered` (a run): may a row the model
    cannot take stay, being registered in the build exactly as it is (sample id, fingerprint)? `regenerate` (a
    regenerating build's --turns): every row is a conversation, held as its first prompt and its messages."""
    gfail, glabel = failer_ or failer(path, kind)

    def fail(row: int, field: str, msg: str, check: Check = Check.FIELDS) -> RowError:
        return gfail(row0 + row, field, msg, check)

    names = set(table.column_names)
    if table.num_rows == 0:
        raise SourceError(path, "has no rows")
    if not names & {"input_ids", "text", *CONVERSATION_FIELDS}:
        raise SourceError(path, f"has none of 'input_ids', 'messages', 'conversations' or 'text' (columns: "
                                f"{sorted(names)})", field="input_ids")
    if regenerate is not None and not names & set(CONVERSATION_FIELDS):
        raise SourceError(path, "has no conversations ('messages' or 'conversations'); --regenerate generates a "
                                "conversation's assistant turns, so its rows must be conversations",
                          field="messages")
    n = table.num_rows
    sids = sample_ids(path, kind, table, types, fail, row0)
    rows = Rows(n, list_column(path, kind, table, "input_ids", pa.types.is_integer, "integers", fail),
                list_column(path, kind, table, "loss_mask", lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t),
                            "0/1 integers", fail))
    found: list[RowError] = []  # the errors found; the least (row, check) is raised
    if regenerate is not None:
        m = _prompts(path, kind, table, rows, chat.as_tokenizer(tokenizer), regenerate, row0, json_rows, fail,
                     found)
    else:
        m = _tokenize(path, kind, table, rows, chat.as_tokenizer(tokenizer), row0, json_rows, fail, found)
    rows.count_tokens()
    found += _seq_len(kind, table, rows, m, fail)
    found += _int32(rows, m, fail)
    cannot_take = _cannot_take(rows, m, vocab_size, registered is not None)
    if registered is None:
        found += _usable(rows, cannot_take, vocab_size, fail)
    found += _mask(rows, m, fail)
    dup = first_duplicate([sids.slice(0, m)], gfail, glabel, kind, row0)
    found += [dup] if dup is not None else []
    if registered is not None:
        stop = min(found, key=_rank).row - row0 if found else m
        found += _registered(rows, sids, cannot_take[cannot_take < stop], vocab_size, registered, fail)
    if found:
        raise min(found, key=_rank)
    return _hold(rows, sids, row0)


def _rank(e: RowError) -> tuple[int, Check]:
    return e.row, e.check


def _first(rows: np.ndarray, before: int) -> int | None:
    """The first of these row numbers below `before` (rows need not be sorted)."""
    rows = rows[rows < before]
    return int(rows.min()) if rows.size else None


def _tokenize(path: Path, kind: str, table: pa.Table, rows: Rows, tok: chat.Tokenizer | None, row0: int,
              json_rows: JsonRows | None, fail: Fail, found: list[RowError]) -> int:
    """Tokenize the rows without input_ids: a conversation with the chat template, else their text. At the first
    that cannot be, its error is found and the rows from it on are not looked at: returns that row (else n)."""
    todo = np.flatnonzero(rows.ids_null)
    if not todo.size:
        return rows.n
    texts = table.column("text") if "text" in table.column_names else None
    convs = conversation_rows(path, kind, table, row0, json_rows)
    for i in todo.tolist():
        try:
            if convs is not None and any(convs[i].get(c) is not None for c in CONVERSATION_FIELDS):
                rows.tokenized[i] = tokenize_conversation(i, convs[i], not rows.mask_null[i], tok, fail)
            else:
                rows.tokenized[i] = tokenize_text(i, texts[i].as_py() if texts is not None else None, tok, fail)
        except RowError as e:
            found.append(e)
            return i
    return rows.n


def _prompts(path: Path, kind: str, table: pa.Table, rows: Rows, tok: chat.Tokenizer | None, turns: str, row0: int,
             json_rows: JsonRows | None, fail: Fail, found: list[RowError]) -> int:
    """A regenerating build's rows: each a conversation, held as its first prompt (extract/prompts.py) with its
    messages. As `_tokenize`: returns the first row that cannot be (else n), its error found."""
    convs = conversation_rows(path, kind, table, row0, json_rows) or [{}] * rows.n
    rows.conversations = {}
    for i in range(rows.n):
        try:
            if not any(convs[i].get(c) is not None for c in CONVERSATION_FIELDS):
                raise fail(i, "input_ids" if not rows.ids_null[i] else "messages", NOT_A_CONVERSATION)
            ids, mask, column, messages = prompt_of_conversation(i, convs[i], not rows.mask_null[i], tok, turns, fail)
        except RowError as e:
            found.append(e)
            return i
        rows.tokenized[i] = (ids, mask, column)
        rows.conversations[i] = messages
    return rows.n


def _seq_len(kind: str, table: pa.Table, rows: Rows, m: int, fail: Fail) -> list[RowError]:
    """A dataset directory's `seq_len` column says how many tokens a row has."""
    if kind != "arrow" or "seq_len" not in table.column_names:
        return []
    seq = table.column("seq_len").combine_chunks()
    seq_null = seq.is_null().to_numpy(zero_copy_only=False)
    seq_val = seq.fill_null(0).to_numpy(zero_copy_only=False)
    r = _first(np.flatnonzero(~seq_null & (seq_val != rows.lens)), m)
    if r is None:
        return []
    return [fail(r, "seq_len", f"is {seq_val[r]} but input_ids has {rows.lens[r]} tokens", Check.SEQ_LEN)]


def _int32(rows: Rows, m: int, fail: Fail) -> list[RowError]:
    """Token ids in the 32-bit range."""
    bad = [i for i, ids in rows.token_lists(rows.n) if out_of_int32(ids)]
    if rows.ids is not None and rows.ids.values.dtype not in NARROW_INTS:
        v = rows.ids.values
        bad += rows.ids.rows_with_values((v < INT32_MIN) | (v > INT32_MAX)).tolist()
    r = _first(np.asarray(bad, dtype=np.int64), m)
    if r is None:
        return []
    return [fail(r, rows.field_of(r), "holds a value outside the 32-bit integer range", Check.INT32)]


def _cannot_take(rows: Rows, m: int, vocab_size: int | None, run: bool) -> np.ndarray:
    """The rows below m the model cannot take (no tokens, an id outside its vocabulary), when that is checked:
    at init (`vocab_size`) or in a run (`run`: against the build's vocabulary, when it recorded one)."""
    if vocab_size is None and not run:
        return np.zeros(0, dtype=np.int64)
    bad = np.flatnonzero(rows.lens[:m] == 0)
    if vocab_size is not None:
        oov = [i for i, ids in rows.token_lists(m) if unusable(ids, vocab_size)]
        if rows.ids is not None:
            v = rows.ids.values
            oov += rows.ids.rows_with_values((v < 0) | (v >= vocab_size)).tolist()
        bad = np.union1d(bad, np.asarray(oov, dtype=np.int64))
    return bad[bad < m]


def _usable(rows: Rows, cannot_take: np.ndarray, vocab_size: int | None, fail: Fail) -> list[RowError]:
    """At init: the first row the model cannot take."""
    if not cannot_take.size:
        return []
    r = int(cannot_take[0])
    return [fail(r, rows.field_of(r), unusable(rows.row_ids(r).astype(np.int32), vocab_size), Check.USABLE)]


def _mask(rows: Rows, m: int, fail: Fail) -> list[RowError]:
    """The loss mask: as long as the tokens, 0 and 1 only (a `loss_mask` column's, or the chat template's)."""
    found = []
    if rows.mask is not None:
        col = rows.mask
        r = _first(np.flatnonzero(~rows.mask_null & (col.lengths != rows.lens)), m)
        if r is not None:
            found.append(fail(r, "loss_mask", f"has {col.lengths[r]} entries but input_ids has {rows.lens[r]}",
                              Check.MASK_LENGTH))
        v = col.values
        bad = col.rows_with_values((v < 0) | (v > 1)) if v.dtype != np.bool_ else np.zeros(0, np.int64)
        r = _first(bad, m)
        if r is not None:
            found.append(fail(r, "loss_mask", "must hold only 0 and 1", Check.MASK_VALUES))
    chat_masks = [i for i in rows.tok_rows.tolist() if i < m and (mask := rows.tokenized[i][1]) is not None
                  and mask.size and (mask.min() < 0 or mask.max() > 1)]
    if chat_masks:
        found.append(fail(chat_masks[0], "loss_mask", "must hold only 0 and 1", Check.MASK_VALUES))
    return found


def _registered(rows: Rows, sids: pa.StringArray, cannot_take: np.ndarray, vocab_size: int | None,
                registered: Callable[[str, str], bool], fail: Fail) -> list[RowError]:
    """A run: a row the model cannot take is refused unless registered exactly as it is (same id, same tokens),
    as a build made before init checked this has it."""
    for r in cannot_take.tolist():
        ids32 = rows.row_ids(r).astype(np.int32)
        mask = rows.row_mask(r)
        mask8 = np.ones(ids32.shape[0], np.uint8) if mask is None else np.asarray(mask).astype(np.uint8)
        if not registered(sids[r].as_py(), fingerprint(ids32, mask8)):
            return [fail(r, rows.field_of(r), unusable(ids32, vocab_size), Check.REGISTERED)]
    return []


def _hold(rows: Rows, sids: pa.StringArray, row0: int) -> SourceSamples:
    """The batch's samples: its tokens and masks in two flat buffers."""
    n, lens = rows.n, rows.lens
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    tokens = np.empty(total, dtype=np.int32)
    if rows.ids is not None:
        _copy_rows(tokens, offsets, rows.ids.values, rows.ids.offsets, np.flatnonzero(~rows.ids_null))
    mask8 = np.ones(total, dtype=np.uint8)
    if rows.mask is not None:
        _copy_rows(mask8, offsets, rows.mask.values, rows.mask.offsets, np.flatnonzero(~rows.mask_null))
    for i, (ids, mask, _) in rows.tokenized.items():
        tokens[offsets[i] : offsets[i + 1]] = ids
        if mask is not None:
            mask8[offsets[i] : offsets[i + 1]] = mask
    starts = offsets[:-1]
    fps = fingerprints(tokens, mask8, starts, lens)
    convs = None
    if rows.conversations is not None:
        convs = pa.array([rows.conversations.get(i) for i in range(n)], pa.string())
        fps = with_conversations(fps, convs)
    return SourceSamples(sids, fps, np.arange(row0, row0 + n, dtype=np.int64), starts, lens, tokens, mask8, convs)


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
