"""What the log stores of a `written` event's checksums: hsbuild's own text as 32 characters, any other as it is.

hsbuild records a sample's checksums as JSON text, `json.dumps({field: "crc32c:xxxxxxxx"}, sort_keys=True)`
over the four fields (TEXT_TEMPLATE). In the log (the events' `checksums`, the fold checkpoint's `m_checksums`)
that text is stored as its 32 hex digits alone, the four values in FIELDS order: 18 B a sample in DuckDB's
storage against 39 B for the text (tools/bench_logsize.py). Any other text (another form, an upper-case digit,
what an older hsbuild wrote) is stored as it is. A stored value is the compact form exactly when it is 32 bytes
that do not begin with `{` (`is_compact`; cheaper in the views than a pattern, 0.3 s a million rows), which a
JSON object's text never is, so both read back exactly. The views give the text back (the macro
`checksums_text`: `samples.checksums` is byte for byte what the event was given), so no reader sees the stored
form.
"""

from __future__ import annotations

import json
import re

# builder.store.segment.FIELDS (tests/log/test_checksums.py checks they are the same; importing it here would
# bring numpy and the codecs into every `status`)
FIELDS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
TEXT_TEMPLATE = json.dumps({f: "crc32c:00000000" for f in FIELDS}, sort_keys=True)
_TEXT = re.compile(re.escape(TEXT_TEMPLATE).replace("00000000", "([0-9a-f]{8})"))
_ORDER = sorted(FIELDS)  # the fields in the text's order
_DIGITS = re.compile(r"[0-9a-f]{32}")


def is_compact(stored: str) -> bool:
    """A stored value in the compact form (the macro's test, on UTF-8 bytes as DuckDB's `strlen`)."""
    return len(stored.encode()) == 32 and not stored.startswith("{")


def compact(text: str | None) -> str | None:
    """What the log stores for a `written` event's checksums `text`: its 32 digits (FIELDS order) when it is
    hsbuild's own text (TEXT_TEMPLATE, lower-case digits), else the text itself; a stored value given again
    (an event's `checksums` as the table holds it) is kept. ValueError for a text that would read back as
    another (32 bytes not beginning with `{`, not 32 hex digits: never a JSON object; the code's mistake)."""
    if text is None:
        return None
    m = _TEXT.fullmatch(text)
    if m is None:
        check(text)
        return text  # another text, or already the stored form (an event's, given again): kept as it is
    by_field = dict(zip(_ORDER, m.groups(), strict=True))
    return "".join(by_field[f] for f in FIELDS)


def check(text: str | None) -> None:
    """ValueError for checksums `text` the log would read back as another text (32 bytes not beginning with `{`,
    not 32 hex digits: never a JSON object; the code's mistake). Cheap for any other text: an Event checks its
    checksums where it is made, `compact` where the log stores them."""
    if text is not None and is_compact(text) and not _DIGITS.fullmatch(text):
        raise ValueError(f"checksums {text!r} are not a JSON object (the log would read them as another text)")


def expand(stored: str | None) -> str | None:
    """The text a stored value stands for (the inverse of `compact`; what the macro `checksums_text` gives)."""
    if stored is None or not is_compact(stored):
        return stored
    digits = {f: stored[8 * i:8 * i + 8] for i, f in enumerate(FIELDS)}
    return json.dumps({f: f"crc32c:{digits[f]}" for f in FIELDS}, sort_keys=True)


def checksums_macro(temp: bool = False) -> str:
    """The macro `checksums_text(c)`: the JSON text a stored value stands for (`expand`, in SQL; the views call
    it, and a user's SQL over `events` may). `temp`: a TEMP macro (which shadows one of the same name in the
    file)."""
    parts: list[str] = []
    rest = TEXT_TEMPLATE
    for f in _ORDER:
        slot = f'"{f}": "crc32c:'
        head, rest = rest.split(slot + "00000000", 1)
        parts.append("'" + (head + slot).replace("'", "''") + "'")
        parts.append(f"substr(c, {8 * FIELDS.index(f) + 1}, 8)")
    parts.append("'" + rest.replace("'", "''") + "'")
    return (f"CREATE OR REPLACE {'TEMP ' if temp else ''}MACRO checksums_text(c) AS "
            f"CASE WHEN strlen(c) = 32 AND NOT starts_with(c, '{{') THEN concat({', '.join(parts)}) ELSE c END;\n\n")
