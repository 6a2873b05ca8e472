"""An fp8 build's states are lossy, and every way out of the build says so: its scheme and the error measured
when each sample was written, summed up over the samples a reader or an export gives out.

The figure is measured at write time, against the exact states the model produced (which the build does not
keep): each sample's relative RMS error per state field, ||read back - exact|| / ||exact|| (store/codec.py
`fp8_error`), recorded in its `written` event as `detail.fp8_error` {hidden_state, aux_hidden_state}. A sample
whose event carries no figure (a log rebuilt from the data: the manifests do not record it) is counted as
unmeasured, never as exact.

An export of an fp8 build writes `hsbuild-lossy.json` beside its files (`export_lossy`), its report carries the
same dict and the export command prints it; `HiddenStateDataset(BUILD).lossy` is it for the dataset's samples;
`BuildInfo.lossy` is the scheme alone (from the build's metadata). A build that stores its states exactly has
none of these (None, no file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from builder.formats.build_info import BuildInfo
from builder.fsutil import atomic_write_bytes

LOSSY_FILE = "hsbuild-lossy.json"
FIELDS = ("hidden_state", "aux_hidden_state")
METRIC = ("relative RMS error of each sample's field as read back, ||read - exact|| / ||exact||, measured when "
          "the sample was written (its `written` event's detail.fp8_error)")

# each live sample's recorded figures: its `written` event is the one at the sample's present location
ERRORS_SQL = """
SELECT s.sample_id,
       max(TRY_CAST(json_extract(e.detail, '$.fp8_error.hidden_state') AS DOUBLE)) AS hidden_state,
       max(TRY_CAST(json_extract(e.detail, '$.fp8_error.aux_hidden_state') AS DOUBLE)) AS aux_hidden_state
FROM samples s
JOIN events e ON e.kind = 'written' AND e.sample_id = s.sample_id AND e.segment = s.segment
              AND e.token_start = s.token_start
WHERE s.state IN ('written', 'verified')
GROUP BY s.sample_id
"""


def summarize(info: BuildInfo, errors: Iterable[tuple[str, float | None, float | None]],
              sample_ids: Iterable[str] | None = None, final_state: str | None = None) -> dict | None:
    """The lossy statement for `sample_ids` (default: every sample in `errors`): the build's scheme and, per
    state field, the mean and max of the samples' recorded errors (and which sample has the max). `errors`:
    (sample_id, hidden_state error, aux_hidden_state error) rows, ERRORS_SQL's. `final_state`: the convention
    the states are given in, when it is not the stored one (post-norm derived from a dequantized pre-norm
    state). None for a build stored exactly."""
    if info.lossy is None:
        return None
    recorded = {str(sid): (hs, aux) for sid, hs, aux in errors}
    ids = list(recorded) if sample_ids is None else [str(s) for s in sample_ids]
    fields: dict[str, dict] = {}
    measured = 0
    for k, name in enumerate(FIELDS):
        vals = [(float(recorded[s][k]), s) for s in ids if s in recorded and recorded[s][k] is not None]
        if k == 0:
            measured = len(vals)
        if vals:
            worst = max(vals)
            fields[name] = {"mean": round(sum(v for v, _ in vals) / len(vals), 6), "max": round(worst[0], 6),
                            "max_sample_id": worst[1]}
        else:
            fields[name] = {"mean": None, "max": None, "max_sample_id": None}
    out = {**info.lossy, "error": {"metric": METRIC, **fields}, "samples": len(ids), "samples_measured": measured,
           "stored_final_state": info.final_state}
    if final_state is not None and final_state != info.final_state:
        out["note"] = (f"hidden_state is stored {info.final_state.replace('_', '-')} and given here "
                       f"{final_state.replace('_', '-')}, derived from the dequantized state with the kept final "
                       "norm; its figures are the stored state's")
    return out


def query_errors(query: Callable[[str], Iterable[tuple]]) -> list[tuple[str, float | None, float | None]]:
    """ERRORS_SQL through `query` (an open log's, or `run_query` on a build)."""
    return [(str(r[0]), r[1], r[2]) for r in query(ERRORS_SQL)]


def export_lossy(out: Path, info: BuildInfo, query: Callable[[str], Iterable[tuple]],
                 sample_ids: Iterable[str], final_state: str | None = None) -> dict | None:
    """An export of an fp8 build: `OUT/hsbuild-lossy.json` (written atomically) for the exported samples, and the
    dict it holds; an exact build: None, and no such file (one left by an earlier export is removed)."""
    path = Path(out) / LOSSY_FILE
    if info.lossy is None:
        path.unlink(missing_ok=True)
        return None
    lossy = summarize(info, query_errors(query), sample_ids, final_state)
    atomic_write_bytes(path, (json.dumps(lossy, indent=2) + "\n").encode())
    return lossy


def describe(lossy: dict) -> str:
    """One line for a person: the scheme and the measured error."""
    e = lossy["error"]
    figures = "; ".join(f"{f} mean {e[f]['mean']:.4f}, max {e[f]['max']:.4f}" for f in FIELDS
                        if e[f]["mean"] is not None)
    unmeasured = lossy["samples"] - lossy["samples_measured"]
    return (f"LOSSY: states stored as {lossy['scheme']} (one float32 scale per token and field), read back as "
            f"{lossy['read_as']}; relative RMS error " + (figures or "not recorded")
            + f" over {lossy['samples_measured']} sample(s)"
            + (f" ({unmeasured} without a recorded figure)" if unmeasured else ""))
