"""`hsbuild report` of a regenerating build (issue 45, figure 3: generated tokens and the truncated share): a real
small build (`init --regenerate`, the built-in model with a vocabulary of 8 so that some sampled responses reach
its EOS within --max-new-tokens and others stop at the limit). The series equal SQL over the log's `written`
events; the page, rendered in headless Chromium, draws the generated-tokens chart with the truncated share."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from browser import chromium, console_errors, figure_svg, render
from conftest import write_jsonl

from builder.layout import layout
from builder.log.events import EventLog

pytest.importorskip("matplotlib", reason="hsbuild report needs the `report` extra (matplotlib)")

MODEL = "builtin:hidden=64,layers=4,heads=2,kv_heads=1,intermediate=128,vocab=8"
MAX_NEW = 6


def test_generated_tokens_and_truncated_share(tmp_path, cli):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}?"}]} for i in range(16)]
    src = write_jsonl(tmp_path / "chats.jsonl", rows)
    build = tmp_path / "b"
    cp = cli("init", build, "--source", src, "--model", MODEL, "--regenerate", "--max-new-tokens", str(MAX_NEW),
             "--temperature", "1.0", "--seed", "3", "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    # before any response: the page's expected tokens are status' (each response counted at its allowance)
    before = json.loads(cli("report", build, "-o", tmp_path / "before.html", "--json").stdout)["now"]
    st = json.loads(cli("status", build, "--json").stdout)
    assert before["tokens_total"] == st["tokens_total"] == st["tokens_done"] + st["todo_tokens"], (before, st)
    assert before["response_allowance"] == MAX_NEW
    cp = cli("run", build, "--no-progress", "--workers", "1", "--device", "cpu")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    page = tmp_path / "report.html"
    cp = cli("report", build, "-o", page, "--json")
    assert cp.returncode == 0, cp.stderr
    g = json.loads(cp.stdout)["generated"]
    with EventLog(layout(build).events, read_only=True) as log:
        ev = log.query("SELECT CAST(json_extract(detail, '$.generated') AS BIGINT), "
                       "json_extract_string(detail, '$.finish_reason') FROM events WHERE kind = 'written'")[1]
    assert len(ev) == len(rows)
    reasons = Counter(r for _, r in ev)
    # both endings present: the share is a real fraction (the seed and the 8-token vocabulary make it so)
    assert set(reasons) == {"stop", "length"} and 0 < reasons["length"] < len(rows), reasons
    assert all(n == MAX_NEW for n, r in ev if r == "length") and all(n <= MAX_NEW for n, _ in ev)
    assert (g["samples"], g["at_token_limit"], g["dropped_at_token_limit"]) == (len(rows), reasons["length"], 0)
    assert g["truncated_share"] == reasons["length"] / len(rows)
    h, gen = g["histogram"], [n for n, _ in ev]
    assert (h["samples"], h["tokens"], h["min"], h["max"]) == (len(gen), sum(gen), min(gen), max(gen))
    edges = h["edges"]
    assert h["counts"] == [sum(edges[j] <= x < edges[j + 1] for x in gen) for j in range(len(edges) - 1)]
    # the chart: the generated tokens' histogram beside the stored lengths, titled with the share, in Chromium
    browser = chromium()
    dom, blog = render(browser, page, tmp_path / "report.png")
    assert not console_errors(blog), console_errors(blog)
    svg = figure_svg(dom, "lengths")
    want = f"{reasons['length']} of {len(rows)} stopped at the token limit ({reasons['length'] / len(rows):.1%})"
    assert want in svg and "generated tokens" in svg, svg[:2000]
