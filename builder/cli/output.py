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
               out: TextIO | None = None) -> None:
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
        cells = [[_cell(v) for v in r] for r in rows]
        widths = [len(c) for c in columns]
        for r in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
        out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip() + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
        for r in cells:
            out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def print_json(obj: object, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    json.dump(obj, out, default=str, indent=None)
    out.write("\n")
