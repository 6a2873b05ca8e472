"""What a source row is, and how its errors rank.

A row is one of three kinds: tokens (`input_ids`, with an optional `loss_mask`), a conversation (`messages` or
`conversations`, tokenized with the model's chat template, extract/chat.py) or `text` (tokenized with the model's
tokenizer). Here: each kind's own rule (`conversation`, `tokenize_conversation`, `tokenize_text`; a tokens row is
checked column by column, extract/source_checks.py), the rules every row's tokens obey (`unusable`, the 32-bit
range), and `Check`: the checks a row passes, in the order a row-by-row pass makes them, which ranks the errors
of a batch (the first bad row's first failing check is the one raised)."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum, auto
from pathlib import Path

import numpy as np

from builder.errors import SourceError
from builder.extract import chat, prompts
from builder.extract.chat import CONVERSATION_FIELDS, ConversationError

INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
MISSING = "missing; each row needs 'input_ids' (list of ints), 'messages', 'conversations' or 'text'"
NOT_A_CONVERSATION = ("--regenerate: a regenerating build takes conversation rows only ('messages' or "
                      "'conversations': their assistant turns are generated); drop this row or give its conversation")


class Check(IntEnum):
    """The checks of a row, in the order a row-by-row pass makes them. Of a batch's errors, the one raised is
    the first row's, and of that row's, the first check's."""

    FIELDS = auto()  # its fields present and of their types; a text or conversation row tokenized
    SEQ_LEN = auto()  # a dataset directory's `seq_len`: the number of its tokens
    INT32 = auto()  # its token ids in the 32-bit range
    USABLE = auto()  # tokens the model can take: at least one, each in its vocabulary
    MASK_LENGTH = auto()  # its loss mask as long as its tokens
    MASK_VALUES = auto()  # its loss mask 0 and 1 only
    UNIQUE_ID = auto()  # its id on no earlier row
    REGISTERED = auto()  # (a run) a row the model cannot take is registered in the build exactly as it is


class RowError(SourceError):
    """A SourceError about one row: `row` (0-based over the whole file) and the `check` it failed rank it."""

    def __init__(self, path: str | Path, message: str, line: int | None = None, field: str | None = None, *,
                 row: int, check: Check = Check.FIELDS):
        super().__init__(str(path), message, line=line, field=field)
        self.row, self.check = row, check


Fail = Callable[..., RowError]  # fail(row, field, message[, check]) -> the RowError naming that row of the file


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


def conversation(obj: dict) -> tuple[str, list[dict]]:
    """A conversation row (no input_ids): its conversation field and its messages, normalized (extract/chat.py).
    Raises FieldError naming the field at fault."""
    given = [c for c in CONVERSATION_FIELDS if obj.get(c) is not None]
    if len(given) > 1:
        raise FieldError(given[1], "a row holds 'messages' or 'conversations', not both")
    column = given[0]
    if obj.get("loss_mask") is not None:
        raise FieldError("loss_mask", f"a '{column}' row's loss mask comes from the chat template (its assistant "
                                      "tokens); drop 'loss_mask', or give 'input_ids' with it")
    try:
        return column, chat.normalize(column, obj[column])
    except ConversationError as e:
        raise FieldError(chat.field_name(column, e.index, e.key), e.message) from None


def tokenize_conversation(i: int, row: dict, has_mask: bool, tok: chat.Tokenizer | None,
                          fail: Fail) -> tuple[np.ndarray, np.ndarray, str]:
    """A conversation row, row `i`: (input_ids, loss_mask, field) with the model's chat template."""
    try:
        column, messages = conversation({**row, "loss_mask": 1 if has_mask else None})
    except FieldError as e:
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


def prompt_of_conversation(i: int, row: dict, has_mask: bool, tok: chat.Tokenizer | None, turns: str,
                           fail: Fail) -> tuple[np.ndarray, np.ndarray, str, str]:
    """A regenerating build's conversation row, row `i` (extract/prompts.py): (its first prompt's tokens, a loss
    mask of zeros, its field, its messages as JSON)."""
    try:
        column, messages = conversation({**row, "loss_mask": 1 if has_mask else None})
    except FieldError as e:
        raise fail(i, e.field, e.message) from None
    if not isinstance(tok, chat.PromptTokenizer) or not tok.has_chat_template():
        raise fail(i, column, "--regenerate needs a model whose tokenizer has a chat template")
    try:
        ids = np.asarray(prompts.first_prompt(tok, messages, turns), dtype=np.int64)
    except ConversationError as e:
        raise fail(i, chat.field_name(column, e.index, e.key), e.message) from None
    return ids, np.zeros_like(ids), column, prompts.dump(messages)


def tokenize_text(i: int, text: object, tok: chat.Tokenizer | None, fail: Fail) -> tuple[np.ndarray, None, str]:
    """A row without tokens or a conversation, row `i`: its `text` (None: absent) tokenized; no loss mask."""
    if text is None:
        raise fail(i, "input_ids", MISSING)
    if not isinstance(text, str):
        raise fail(i, "text", "must be a string")
    if tok is None:
        raise fail(i, "text", "needs a tokenizer, but the model has none")
    return np.asarray(tok.encode(text), dtype=np.int64), None, "text"


def unusable(ids: np.ndarray, vocab_size: int | None) -> str | None:
    """Why the model cannot take these tokens (no tokens, an id outside its vocabulary), or None."""
    if not ids.size:
        return "has no tokens; a sample needs at least one (drop the row)"
    if vocab_size is not None:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            return f"token id {int(bad[0])} is outside the model's vocabulary 0..{vocab_size - 1}"
    return None


def out_of_int32(ids: np.ndarray) -> bool:
    return bool(ids.size) and (ids.min() < INT32_MIN or ids.max() > INT32_MAX)
