"""The output formats every command shares: a table for people, `--json` and `--csv` for machines."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from typing import TextIO


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_rows(columns: Sequence[str], rows: Sequence[Sequence[object]], fmt: str = "table",
               out: TextIO | None = None, whole: Sequence[str] = ()) -> None:
    """`whole`: columns a table never cuts (what the user acts on: a file path, a sample id)."""
    out = out or sys.stdout
    if fmt == "json":
        json.dump([dict(zip(columns, r, strict=True)) for r in rows], out, default=str)
        out.write("\n")
    elif fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if v is None else v for v in r])
    else:
        cut = print_table(columns, rows, out, whole)
        if cut:
            sys.stderr.write(f"note: {cut} value(s) cut at {MAX_WIDTH} characters (…); --json or --csv prints "
                             "every value whole\n")


MAX_WIDTH = 100  # a table column is at most this wide (--json/--csv print every value whole)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO,
                whole: Sequence[str] = ()) -> int:
    """A plain table, each column as wide as its widest value but at most MAX_WIDTH. A longer one-line value is
    cut (…), except in the columns named in `whole`, which are as wide as their widest value. A value with line
    breaks (an EXPLAIN plan, a TOML config) is printed whole, one line under the other: it is preformatted, so
    its lines are never cut, and a line wider than the column runs past it instead of widening every row.
    Returns how many values were cut."""
    cut = 0

    def lines(v: object, keep: bool = False) -> list[str]:
        nonlocal cut
        text = _cell(v).replace("\t", "    ")
        if "\n" in text or "\r" in text:
            return text.splitlines()
        if len(text) > MAX_WIDTH and not keep:
            cut += 1
            return [text[: MAX_WIDTH - 1] + "…"]
        return [text]

    keep = [c in whole for c in columns]
    header = [lines(c)[0] for c in columns]
    cells = [[lines(v, k) or [""] for v, k in zip(r, keep, strict=True)] for r in rows]
    widths = [len(c) for c in header]
    for r in cells:
        widths = [max(w, *(len(x) for x in c)) if k else min(MAX_WIDTH, max(w, *(len(x) for x in c)))
                  for w, c, k in zip(widths, r, keep, strict=True)]
    out.write("  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in cells:
        for i in range(max(len(c) for c in r) if r else 1):
            line = [c[i] if i < len(c) else "" for c in r]
            out.write("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() + "\n")
    return cut


def print_json(obj: object, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump(obj, out, default=str, indent=None)
    out.write("\n")
