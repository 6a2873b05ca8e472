"""An fp8 build's measured error survives a lost log: each group's manifest records it, and `rebuild-log` puts it
back into the `written` events, so `hsbuild-lossy.json` of a later export still has its figures."""

from __future__ import annotations

import json

from conftest import hsbuild

from builder.layout import layout
from builder.log.query import run_query
from builder.run.coordinator import RunOptions, run_build


def _errors(build) -> dict[str, dict]:
    _, rows = run_query(layout(build), "SELECT sample_id, detail FROM events WHERE kind = 'written'")
    return {sid: json.loads(d).get("fp8_error") for sid, d in rows}


def test_rebuild_log_keeps_an_fp8_builds_measured_error(make_build):
    build = make_build(n=9, quantize="fp8")
    assert run_build(build, RunOptions(workers=1), echo=lambda _m: None).written == 9
    before = _errors(build)
    assert len(before) == 9 and all(e and set(e) == {"hidden_state", "aux_hidden_state"} for e in before.values())
    for p in layout(build).root.glob("events.duckdb*"):
        p.unlink()
    cp = hsbuild("rebuild-log", build)
    assert cp.returncode == 0, cp.stderr
    assert _errors(build) == before
