"""A regenerating build's conversations (`hsbuild init --regenerate`): which assistant turns are generated, and
the prompt each one is generated after. Torch-free: the source reads it at init and at each run's start, the
run's turn loop (builder/run/regenerate.py) in its workers.

The turns a conversation regenerates are its assistant messages, in order, and, when it ends with another role
(a prompt without its answer), one more turn at its end: `--turns all` regenerates each of them, each prompt
holding the regenerated text of the turns before it; `--turns last` only the final one, after the conversation's
own earlier messages. The prompt of a turn is the messages before it rendered with the model's chat template
and its generation prompt (`PromptTokenizer.prompt`). A message after the final turn is never one (the final
turn is the last assistant message, or the end)."""

from __future__ import annotations

import json
from typing import Any

from builder.extract.chat import ConversationError, PromptTokenizer

TURNS = ("all", "last")


def targets(messages: list[dict[str, Any]], turns: str) -> list[int]:
    """The positions of the turns to generate, in order (a position equal to len(messages): a turn appended)."""
    found = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not messages or messages[-1].get("role") != "assistant":
        found.append(len(messages))
    return found if turns == "all" else found[-1:]


def first_prompt(tok: PromptTokenizer, messages: list[dict[str, Any]], turns: str) -> list[int]:
    """The tokens of the first prompt a conversation is generated after. Raises ConversationError (a template
    that refuses the conversation)."""
    ids, _ = tok.prompt(messages[: targets(messages, turns)[0]])
    return list(ids)


def answered(messages: list[dict[str, Any]], at: int, text: str) -> list[dict[str, Any]]:
    """The messages with the turn at `at` replaced by the generated `text` (appended when at == len): an assistant
    message of text only (a source's tool calls are not generated again)."""
    turn = {"role": "assistant", "content": text}
    return [*messages[:at], turn, *messages[at + 1:]]


def dump(messages: list[dict[str, Any]]) -> str:
    """A conversation as the run carries it to its workers (and as its fingerprint covers it): compact JSON."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def load(text: str) -> list[dict[str, Any]]:
    messages = json.loads(text)
    if not isinstance(messages, list):
        raise ConversationError("not a list of messages")
    return messages
