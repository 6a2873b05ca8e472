"""Some samples' rows of a source as it is now, read as `init` reads them (extract/source.py): each row's sample
id by the same rule, its kind (tokens, conversation, text), a conversation's messages (OpenAI form) and the
fingerprint of its tokens as the chat template makes them. What `hsbuild export --format chat` takes the
conversations from, and how it knows that a row is still the one the build stored (its fingerprint is the log's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from builder.extract import chat
from builder.extract.chat import CONVERSATION_FIELDS
from builder.extract.samples import fingerprint
from builder.extract.source import _open
from builder.extract.source_checks import conversation_rows, failer, sample_ids
from builder.extract.source_jsonl import JsonRows
from builder.extract.source_rows import RowError, conversation, tokenize_conversation
from builder.formats.base import SourceRow

BATCH_ROWS = 8192


def _nulls(table, name: str) -> list[bool]:  # noqa: ANN001 - (a pyarrow Table)
    if name not in table.column_names:
        return [True] * table.num_rows
    return table.column(name).is_null().to_pylist()


def lookup_rows(path: str | Path, wanted: Iterable[str],
                tokenizer: chat.Tokenizer | None) -> tuple[bool, dict[str, SourceRow]]:
    """Whether the source has a conversation column, and the rows of the sample ids `wanted` (an id the source
    no longer holds is absent; an id on two rows: the first, its `problem` naming the second). A conversation
    row is tokenized with `tokenizer` as `init` does; one it cannot take says why in `problem`. SourceError
    when the file cannot be read at all."""
    path = Path(path)
    want = set(wanted)
    found: dict[str, SourceRow] = {}
    has_conversations = False
    with contextlib.ExitStack() as stack:
        kind, types, batches = _open(path, BATCH_ROWS, stack)
        fail, _ = failer(path, kind)
        json_rows = JsonRows(path) if kind == "json" else None
        row0 = 0
        for table in batches:
            n = table.num_rows
            has_conversations |= any(c in table.column_names for c in CONVERSATION_FIELDS)

            def fail_here(i: int, field: str, msg: str, *a: object, _row0: int = row0) -> RowError:
                return fail(_row0 + i, field, msg, *a)

            ids = sample_ids(path, kind, table, types, fail_here, row0).to_pylist()
            mine = [i for i, sid in enumerate(ids) if sid in want]
            if mine:
                convs = conversation_rows(path, kind, table, row0, json_rows)
                no_ids, no_mask, no_text = (_nulls(table, c) for c in ("input_ids", "loss_mask", "text"))
                for i in mine:
                    sid = ids[i]
                    if sid in found:
                        found[sid].problem = f"id {sid!r} is on two rows of the source ({found[sid].row} and " \
                                             f"{row0 + i})"
                        found[sid].fingerprint = None
                        continue
                    conv = convs[i] if convs is not None else {}
                    if not no_ids[i]:
                        found[sid] = SourceRow(sid, row0 + i, "tokens")
                    elif any(conv.get(c) is not None for c in CONVERSATION_FIELDS):
                        found[sid] = _conversation(sid, row0 + i, conv, not no_mask[i], tokenizer, fail_here, i)
                    else:
                        found[sid] = SourceRow(sid, row0 + i, "text" if not no_text[i] else "none")
            row0 += n
    return has_conversations, found


def _conversation(sid: str, row: int, conv: dict, has_mask: bool, tok: chat.Tokenizer | None, fail,  # noqa: ANN001
                  i: int) -> SourceRow:
    try:
        _, messages = conversation({**conv, "loss_mask": 1 if has_mask else None})
        ids, mask, _ = tokenize_conversation(i, conv, has_mask, tok, fail)
    except RowError as e:
        return SourceRow(sid, row, "conversation", problem=str(e))
    except chat.ConversationError as e:
        return SourceRow(sid, row, "conversation", problem=e.message)
    except ValueError as e:  # (a FieldError: tokenize_conversation names the same field first)
        return SourceRow(sid, row, "conversation", problem=str(e))
    return SourceRow(sid, row, "conversation", messages,
                     fingerprint(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
