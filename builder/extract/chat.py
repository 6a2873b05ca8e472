"""Conversation rows: OpenAI `messages` or ShareGPT `conversations`, tokenized with the model's chat template.

A tokenizer of hsbuild (`Tokenizer`) has `encode(text) -> ids` (a `text` row) and `chat(messages) -> (ids,
mask)` (a conversation row; the mask is 1 on the assistant's tokens, and becomes the sample's `loss_mask`).
The built-in model's tokenizer has a byte-level chat template of its own (extract/spec.py BuiltinTokenizer).

A Hugging Face tokenizer renders the conversation with its own chat template. When the template marks the
assistant's text with `{% generation %}` ... `{% endgeneration %}`, transformers' `assistant_masks` is the mask.
Otherwise the mask is found from the rendered text: each assistant message's content is looked up in the
rendering after the rendering of the messages before it, and its tokens are 1, plus the end-of-turn token when
the template puts a special token (`</s>`, `<|im_end|>`, `<|eot_id|>`, ...) right after the content (spaces
aside), as `{% generation %}` templates mark it. Role headers (`<|assistant|>\\n`) and the text between turns
stay 0. Tokens are mapped to characters with the tokenizer's offsets (a fast tokenizer), the way transformers
maps `{% generation %}` spans: a token overlapping the assistant's text is 1.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
CONVERSATION_FIELDS = ("messages", "conversations")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPACES = re.compile(r"[ \t]*")


class ConversationError(ValueError):
    """A conversation the tokenizer cannot take. `index` and `key` name the message and its key (OpenAI names:
    `role`, `content`); None when the whole conversation is meant. The source turns it into a SourceError."""

    def __init__(self, message: str, index: int | None = None, key: str | None = None):
        super().__init__(message)
        self.message, self.index, self.key = message, index, key


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]: ...


class TextOnlyTokenizer:
    """A plain `text -> ids` function as a Tokenizer: it has no chat template."""

    def __init__(self, fn, what: str = "the model's tokenizer"):
        self._fn, self.what = fn, what

    def encode(self, text: str) -> list[int]:
        return self._fn(text)

    __call__ = encode

    def chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        raise ConversationError(f"{self.what} has no chat template; conversation rows need a model with one "
                                "(--model HF_DIR)")

    prompt = chat

    def has_chat_template(self) -> bool:
        return False


@runtime_checkable
class PromptTokenizer(Protocol):
    """What a regenerating build (`init --regenerate`) needs of a tokenizer besides `Tokenizer`: `prompt(messages)`
    renders a conversation as the prompt of the assistant's next turn (the chat template with
    `add_generation_prompt`; the mask 1 on the assistant turns it holds), `decode(ids)` gives the text of
    generated tokens (special tokens left out), which the next turn's prompt holds."""

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def has_chat_template(self) -> bool: ...


def as_tokenizer(tokenizer) -> Tokenizer | None:
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    return TextOnlyTokenizer(tokenizer)


def field_name(column: str, index: int | None = None, key: str | None = None) -> str:
    """`messages[2].role`; a ShareGPT row names its own keys: `conversations[2].from`."""
    if index is None:
        return column
    if column == "conversations":
        key = {"role": "from", "content": "value"}.get(key, key)
    return f"{column}[{index}]" + (f".{key}" if key else "")


def _show(v: object) -> str:
    if isinstance(v, str):
        return repr(v) if len(v) <= 40 else repr(v[:37]) + "..."
    if v is None:
        return "null"
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (list, "a list"), (dict, "an object"))
    return next((what for t, what in kinds if isinstance(v, t)), type(v).__name__)


def normalize(column: str, value: object) -> list[dict[str, Any]]:
    """A row's `messages` (OpenAI) or `conversations` (ShareGPT) as OpenAI messages for a chat template.

    Keys holding null are dropped (a Parquet struct column has every key of every row). Raises
    ConversationError naming the message and key."""
    if not isinstance(value, list):
        raise ConversationError(f"must be a list of messages, not {_show(value)}")
    if not value:
        raise ConversationError("is empty; a conversation needs at least one message")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ConversationError(f"must be an object, not {_show(msg)}", i)
        msg = {k: v for k, v in msg.items() if v is not None}
        if column == "conversations":
            who, text = msg.get("from"), msg.get("value")
            if who is None:
                raise ConversationError("missing; each turn needs 'from' (human, gpt or system)", i, "role")
            if who not in SHAREGPT_ROLES:
                raise ConversationError(f"{_show(who)} is not one of {', '.join(SHAREGPT_ROLES)}", i, "role")
            if not isinstance(text, str):
                raise ConversationError("missing; each turn needs 'value' (a string)" if text is None
                                        else f"must be a string, not {_show(text)}", i, "content")
            out.append({"role": SHAREGPT_ROLES[who], "content": text})
            continue
        role, content = msg.get("role"), msg.get("content")
        if role is None:
            raise ConversationError(f"missing; each message needs 'role' ({', '.join(ROLES)})", i, "role")
        if role not in ROLES:
            raise ConversationError(f"{_show(role)} is not one of {', '.join(ROLES)}", i, "role")
        if content is None and not (role == "assistant" and msg.get("tool_calls")):
            raise ConversationError("missing; each message needs 'content' (a string)", i, "content")
        if content is not None and not isinstance(content, str):
            raise ConversationError(f"must be a string, not {_show(content)}", i, "content")
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# ---------------------------------------------------------------------------------------------------


def template_of(tok) -> str | None:
    """The tokenizer's default chat template (None when it has none)."""
    if not getattr(tok, "chat_template", None):
        return None
    try:
        return tok.get_chat_template()
    except (ValueError, TypeError):
        return None


def hf_chat(tok, messages: list[dict[str, Any]], name: str = "the model's tokenizer",
            prompt: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, assistant mask) of a conversation with a transformers tokenizer's chat template. `prompt`: the
    conversation as the prompt of the assistant's next turn (`add_generation_prompt`: the template's header of
    an assistant turn at the end, its tokens 0), what a regenerating build generates after."""
    template = template_of(tok)
    if template is None:
        raise ConversationError(f"{name} has no chat_template; conversation rows need a model whose tokenizer has "
                                "one (or give input_ids and loss_mask)")
    has_content = any(m["role"] == "assistant" and m.get("content") for m in messages)
    if prompt and not has_content:  # nothing to mask: the rendering's tokens, as apply_chat_template gives them
        ids = list(_render(tok, messages, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])
        return ids, [0] * len(ids)
    if _GENERATION.search(template):
        out = _render(tok, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                      add_generation_prompt=prompt)
        ids, mask = list(out["input_ids"]), out.get("assistant_masks")
        if mask is not None and len(mask) == len(ids) and (any(mask) or not has_content):
            return ids, [int(bool(x)) for x in mask]
        # the markers did not cover this conversation's assistant text: find it in the rendering instead
    return _spans_chat(tok, messages, name, prompt)


def _render(tok, messages, **kw):
    try:
        return tok.apply_chat_template(messages, **kw)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError (raise_exception), a bad key, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversationError(f"the chat template refuses this conversation ({msg})") from None


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):  # a template that renders a conversation's prefix as the prefix of its rendering
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _special_strings(tok) -> list[str]:
    found = set(getattr(tok, "all_special_tokens", None) or [])
    for t in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            found.add(str(t))
    return sorted((s for s in found if s), key=len, reverse=True)


def _spans_chat(tok, messages: list[dict[str, Any]], name: str, prompt: bool = False) -> tuple[list[int], list[int]]:
    text = _render(tok, messages, tokenize=False, add_generation_prompt=prompt)
    specials = _special_strings(tok)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if msg["role"] != "assistant" or not content:
            continue
        before = _render(tok, messages[:i], tokenize=False) if i else ""
        start = max(cursor, _common_prefix(before, text))
        pos, found = text.find(content, start), content
        if pos < 0 and content.strip() != content and content.strip():  # templates that `| trim`
            found = content.strip()
            pos = text.find(found, start)
        if pos < 0:
            raise ConversationError(
                "the chat template does not render this assistant message's content verbatim, so its tokens "
                f"cannot be found; give {name} a template that marks assistant text with {{% generation %}}",
                i, "content")
        end = pos + len(found)
        gap = _SPACES.match(text, end).end() - end
        eot = next((s for s in specials if text.startswith(s, end + gap)), None)
        if eot is not None:
            limit = len(text)
            if i + 1 < len(messages) or prompt:  # the end-of-turn token is this turn's, never the next one's
                # header (nor the generation prompt's)
                upto = _render(tok, messages[: i + 1], tokenize=False)
                if text.startswith(upto):
                    limit = len(upto)
            if end + gap + len(eot) <= limit:
                end += gap + len(eot)
        spans.append((pos, end))
        cursor = end
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ConversationError(f"{name} is not a fast tokenizer (no offsets): its chat template has no "
                                "{% generation %} markers, so the assistant tokens cannot be found") from None
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for t, (a, b) in enumerate(offsets):
        while s < len(spans) and a >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if b > spans[s][0]:
            mask[t] = 1
    return ids, mask
