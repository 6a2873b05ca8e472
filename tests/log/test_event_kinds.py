"""The kinds of event are one list, `builder.log.kinds.EventKind`: schema/events.sql's comment on `events.kind`
and docs/design.md section 3's table name exactly its members, every event the code makes is of one of them,
and an event of another kind is refused where it is made (before anything is written)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import builder
from builder.log.events import Event, EventLog, schema_dir
from builder.log.kinds import EventKind

ROOT = Path(builder.__file__).resolve().parent.parent
KINDS = [k.value for k in EventKind]


def schema_comment_kinds() -> list[str]:
    """The kinds the comment on `events.kind` lists: 'label: a, b (what b is), c; label: d, ...'."""
    ddl = (schema_dir() / "events.sql").read_text()
    block = re.search(r"^\s+kind\s+VARCHAR[^\n]*\n(.*?)^\s+run_id\s", ddl, re.M | re.S)
    assert block, "schema/events.sql: no comment on events.kind"
    first = ddl[block.start():block.start(1)]
    lines = [first, *block.group(1).splitlines()]
    text = " ".join(line.split("--", 1)[1] for line in lines if "--" in line)
    while re.search(r"\([^()]*\)", text):  # drop what the parentheses say about a kind
        text = re.sub(r"\([^()]*\)", "", text)
    return [k.strip() for part in text.split(";") for k in part.rsplit(":", 1)[-1].split(",")]


def design_table_kinds() -> list[str]:
    """The first column of the table in docs/design.md section 3 whose header is 'kind'."""
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc[doc.index("## 3. The event log"):doc.index("### The fold")]
    rows = re.findall(r"^\| `([^`|]+)` \|", section, re.M)
    assert re.search(r"^\| kind \|", section, re.M), "docs/design.md section 3: no table of event kinds"
    return rows


def test_the_schema_comment_lists_exactly_the_kinds():
    listed = schema_comment_kinds()
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({k for k in listed if listed.count(k) > 1})}"
    assert set(listed) == set(KINDS), (f"schema/events.sql lacks {sorted(set(KINDS) - set(listed))}, "
                                       f"names {sorted(set(listed) - set(KINDS))} that are no EventKind")


def test_the_design_table_lists_exactly_the_kinds():
    listed = design_table_kinds()
    assert len(listed) == len(set(listed))
    assert set(listed) == set(KINDS), (f"docs/design.md section 3 lacks {sorted(set(KINDS) - set(listed))}, "
                                       f"names {sorted(set(listed) - set(KINDS))} that are no EventKind")


def emitted_kinds() -> dict[str, list[str]]:
    """Every kind builder/ names where it makes an Event (`Event("kind", ...)`, `Event(EventKind.X, ...)`)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "builder").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Event"):
                continue
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "kind"), None)
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.setdefault(arg.value, []).append(where)
            elif isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "EventKind":
                found.setdefault(EventKind[arg.attr].value, []).append(where)
            else:
                found.setdefault(f"<not a literal kind: {ast.unparse(arg) if arg else None}>", []).append(where)
    return found


def test_the_code_makes_events_of_the_kinds_only_and_each_kind_is_made():
    found = emitted_kinds()
    assert set(found) <= set(KINDS), {k: v for k, v in found.items() if k not in KINDS}
    assert set(KINDS) <= set(found), f"kinds no code makes (drop them, or the code lost them): " \
                                     f"{sorted(set(KINDS) - set(found))}"


def test_an_event_of_another_kind_is_refused_before_it_is_written(tmp_path):
    with EventLog(tmp_path / "events.duckdb") as log:
        with pytest.raises(ValueError, match="'note' is not one of builder.log.kinds.EventKind"):
            log.append([Event("gc"), Event("note")])
        assert log.query("SELECT count(*) FROM events")[1][0][0] == 0
        log.append([Event(EventKind.GC), Event("gc")])  # a member and its string are the same kind
        assert log.query("SELECT kind FROM events ORDER BY seq")[1] == [("gc",), ("gc",)]
