"""A JSONL source line by line, in Python: where DuckDB (which reads the bulk) rejects the file or types a column
in a way that hides the culprit, the scan names the exact line and field; and the rows as the lines hold them
(a conversation's messages exactly as written, which DuckDB would unify into one type across rows)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from builder.errors import SourceError
from builder.extract.chat import CONVERSATION_FIELDS
from builder.extract.source_rows import INT32_MAX, INT32_MIN, MISSING, FieldError, conversation


def iter_json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) per non-blank line; lines end at '\n' only, as DuckDB and
    `json_line_numbers` count them. Raises UnicodeDecodeError at the first line that is not UTF-8."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():  # blank, as json_line_numbers and DuckDB see it
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


def scan_json_lines(path: Path) -> None:
    """Find the first bad line of a JSONL file and raise SourceError for it."""
    try:
        for lineno, obj in iter_json_lines(path):
            check_record(path, lineno, obj)
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


def check_record(path: Path, line: int, obj: object) -> None:
    """One line's object as a row, of whichever kind it is: raises SourceError naming the line and field."""
    if not isinstance(obj, dict):
        raise SourceError(path, f"expected a JSON object, got {type(obj).__name__}", line=line)
    if "input_ids" in obj:
        _check_tokens_record(path, line, obj)
    elif any(obj.get(c) is not None for c in CONVERSATION_FIELDS):
        try:
            conversation(obj)
        except FieldError as e:
            raise SourceError(path, e.message, line=line, field=e.field) from None
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise SourceError(path, "must be a string", line=line, field="text")
    else:
        raise SourceError(path, MISSING, line=line, field="input_ids")
    if obj.get("id") is not None and not (isinstance(obj["id"], str) or _is_int(obj["id"])):
        raise SourceError(path, f"must be a string or an integer, not {json.dumps(obj['id'])}", line=line,
                          field="id")


def _check_tokens_record(path: Path, line: int, obj: dict) -> None:
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


def json_line_numbers(path: Path) -> list[int]:
    """The line number of each row (blank lines are no rows)."""
    out = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                out.append(lineno)
    return out


class JsonRows:
    """A JSONL file's rows (parsed lines, blank lines skipped) read forward: `rows(row0, n)` for batches that
    come in order, each line parsed once."""

    def __init__(self, path: Path):
        self._lines_path = path
        self._lines = iter_json_lines(path)
        self._next = 0  # the row _lines yields next

    def rows(self, row0: int, n: int) -> list[object]:
        if row0 < self._next:  # asked again for rows already passed: start over
            self._lines, self._next = iter_json_lines(self._lines_path), 0
        skip = row0 - self._next
        out = [obj for _, obj in itertools.islice(self._lines, skip, skip + n)]
        self._next = row0 + len(out)
        return out
