"""Some samples' rows of a source as it is now: each one's kind (tokens, conversation, text), a conversation's
messages (OpenAI form, as `init` normalizes them) and the fingerprint the source gives the sample now, taken from
the source read exactly as `init` reads it (`build_meta.source_samples`, whatever the build's mode), so that a
row is the one the build stored exactly when that fingerprint is the log's. What `hsbuild export --format chat`
takes the conversations from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from builder.extract import chat
from builder.extract.chat import CONVERSATION_FIELDS
from builder.extract.source import open_batches
from builder.extract.source_checks import conversation_rows
from builder.extract.source_jsonl import JsonRows
from builder.formats.base import SourceRow

BATCH_ROWS = 8192


def _nulls(table, name: str) -> list[bool]:  # noqa: ANN001 - (a pyarrow Table)
    if name not in table.column_names:
        return [True] * table.num_rows
    return table.column(name).is_null().to_pylist()


def lookup_rows(path: str | Path, wanted: Iterable[str], samples: Sequence) -> tuple[bool, dict[str, SourceRow]]:
    """Whether the source at `path` has a conversation column, and the rows of the sample ids `wanted` (an id the
    source no longer holds is absent). `samples`: the source's samples as `init` reads them (extract/source.py
    `load_source`: ids, rows, fingerprints). SourceError when the file cannot be read."""
    path = Path(path)
    want = set(wanted)
    cols = samples.registry_columns() if hasattr(samples, "registry_columns") else None
    if cols is not None:
        ids, rows, fps = (cols[k].to_pylist() for k in ("sample_id", "row_idx", "fingerprint"))
    else:
        ids, rows, fps = [s.sample_id for s in samples], [s.row for s in samples], [s.fingerprint for s in samples]
    found = {sid: SourceRow(sid, int(row), "none", fingerprint=fp)
             for sid, row, fp in zip(ids, rows, fps, strict=True) if sid in want}
    by_row = {r.row: r for r in found.values()}
    has_conversations = False
    with contextlib.ExitStack() as stack:
        kind, _, batches = open_batches(path, BATCH_ROWS, stack)
        json_rows = JsonRows(path) if kind == "json" else None
        row0 = 0
        for table in batches:
            n = table.num_rows
            has_conversations |= any(c in table.column_names for c in CONVERSATION_FIELDS)
            mine = [r for r in range(row0, row0 + n) if r in by_row]
            if mine:
                convs = conversation_rows(path, kind, table, row0, json_rows) or [{}] * n
                no_ids, no_text = _nulls(table, "input_ids"), _nulls(table, "text")
                for r in mine:
                    i, got = r - row0, by_row[r]
                    column = next((c for c in CONVERSATION_FIELDS if convs[i].get(c) is not None), None)
                    if not no_ids[i]:  # explicit tokens win over a conversation, as in `init`
                        got.kind = "tokens"
                    elif column is not None:
                        got.kind, got.messages = "conversation", chat.normalize(column, convs[i][column])
                    elif not no_text[i]:
                        got.kind = "text"
            row0 += n
    return has_conversations, found
