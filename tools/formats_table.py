"""Write the table of trainer formats in docs/design.md (section 13) from the format registry: one row a format,
each from its module's `doc` (builder/formats/base.py DocRow). tests/formats/test_registry.py fails while the
document differs from what this writes.

    python tools/formats_table.py           # rewrite the table in docs/design.md
    python tools/formats_table.py --check   # exit 1 if it is not up to date
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("HSBUILD_FORMATS", None)  # hsbuild's own formats only

from builder.formats.registry import docs_table  # noqa: E402

DOC = ROOT / "docs" / "design.md"
BEGIN = "<!-- the formats table: written by tools/formats_table.py from builder/formats/registry.py -->\n"
END = "<!-- end of the formats table -->\n"


def with_table(text: str) -> str:
    """`text` (docs/design.md) with the table between its markers written afresh."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise SystemExit(f"{DOC}: the markers of the formats table are missing")
    return head + BEGIN + docs_table() + END + tail


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = with_table(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC}: the formats table is out of date: python tools/formats_table.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
