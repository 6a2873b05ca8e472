"""`hsbuild import`: trainers' dumps brought into a build, matched to the source by token ids, every file checked,
unusable files listed with their reason and left for `resume`, the dump never modified, and what is imported
bit-exact to what the build would have extracted itself.

Real builds of the small builtin model; the dumps are real exports of a fully run build (`export_build`), then
damaged the way the incident damaged them (files missing, one cut short, SpecForge batch padding), or
hand-made with torch.save as a home-grown script writes them. Which layers a dump holds comes from its own
metadata (an hsbuild export's journal) or `--dump-layers`, and a dump of other layers or widths is refused whole."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOMY, random_rows, write_jsonl

from builder.errors import UsageError
from builder.exchange.export import JOURNAL, ExportOptions, export_build
from builder.exchange.imports import CONVENTIONS, BuildGeometry, DumpRefused, ImportOptions
from builder.formats import make_format
from builder.formats.base import Sample as TrainerSample
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
H, N_AUX = 64, 3
# the default aux layers of a 4-layer model (hidden_states 1, 2, 3): a trainer format's own numbering of them
DECODER_IDS, HF_IDS = "0,1,2", "1,2,3"
N = 16
WM = ("--low", "0.997", "--high", "0.998", "--flood", "0.999")  # as ROOMY: a fairly full CI disk never pauses


def quiet(_msg: str) -> None:
    pass


# -- helpers ------------------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.contiguous().numpy()


def states_of(build: Path) -> dict[str, dict]:
    return {it["sample_id"]: it for it in HiddenStateDataset(build)}


def assert_same_states(build: Path, want: dict[str, dict], ids: set[str] | None = None) -> None:
    """Every (selected) sample of `build` holds exactly `want`'s tokens, mask and states, bit for bit."""
    got = states_of(build)
    ids = set(want) if ids is None else ids
    assert ids <= set(got), f"not in the build: {sorted(ids - set(got))}"
    for sid in sorted(ids):
        g, w = got[sid], want[sid]
        for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state"):
            assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, (sid, k)
            assert np.array_equal(bits(g[k]), bits(w[k])), f"{sid}: {k} differs"


def sha256_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def events(build: Path, sql: str, params=()) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts(sql, params)


def last_run(build: Path) -> str:
    return events(build, "SELECT run_id FROM events WHERE kind = 'run_started' ORDER BY seq DESC LIMIT 1")[0]["run_id"]


def started_in(build: Path, run_id: str) -> dict[str, dict]:
    rows = events(build, "SELECT sample_id, attempt, json_extract_string(detail, '$.origin') AS origin "
                         "FROM events WHERE kind = 'started' AND run_id = ?", [run_id])
    assert len(rows) == len({r["sample_id"] for r in rows}), "a sample started twice in one run"
    return {r["sample_id"]: r for r in rows}


def provenance(build: Path) -> dict[str, tuple[str | None, str | None]]:
    """sample id -> (detail.import.file, detail.import.format) of its `written` event."""
    rows = events(build, "SELECT sample_id, json_extract_string(detail, '$.import.file') AS file, "
                         "json_extract_string(detail, '$.import.format') AS format FROM events "
                         "WHERE kind = 'written'")
    return {r["sample_id"]: (r["file"], r["format"]) for r in rows}


def sample_states(build: Path) -> dict[str, str]:
    with EventLog(layout(build).events, read_only=True) as log:
        return {r["sample_id"]: r["state"] for r in log.samples()}


def by_tokens(rows: list[dict]) -> dict[tuple[int, ...], str]:
    return {tuple(r["input_ids"]): r["id"] for r in rows}


def table(stdout: str) -> list[str]:
    """The rows of the CLI's table of unusable files (after its header and rule)."""
    lines = stdout.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("path ")), None)
    if head is None:
        return []
    out = []
    for line in lines[head + 2:]:
        if line.startswith("their samples are left"):
            break
        out.append(line)
    return out


# -- the source build, run once for the module ----------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Build A: the source fully run (post-norm), and its pristine specforge and modelopt exports."""
    root = tmp_path_factory.mktemp("import-src")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSBUILD_CACHE_DIR", str(root / "hsbuild-cache"))
        rows = random_rows(N, seed=21, hi=60)
        src = write_jsonl(root / "source.jsonl", rows)
        a = init_build(root / "a", src, model=MODEL, watermarks=ROOMY, final_state="post_norm").root
        rep = run_build(a, RunOptions(workers=1), echo=quiet)
        assert (rep.outcome, rep.written) == ("completed", N)
        for fmt in ("specforge", "modelopt"):
            assert export_build(a, root / fmt, ExportOptions(format=fmt)).exported == N
        return SimpleNamespace(root=root, src=src, rows=rows, a=a, states=states_of(a))


def new_build(tmp_path: Path, source, name: str, **kw) -> Path:
    kw.setdefault("watermarks", ROOMY)
    kw.setdefault("final_state", "post_norm")  # as A, and as SpecForge's and Model-Optimizer's dumps
    return init_build(tmp_path / name, source.src, model=MODEL, **kw).root


def imports(d: Path, fmt: str, layers: list[int] | None = None, conv: str | None = None, **kw) -> RunOptions:
    return RunOptions(workers=1, imports=ImportOptions(str(d), fmt, dump_layers=layers, layer_convention=conv), **kw)


def import_details(build: Path) -> tuple[dict, dict]:
    """(the last run_started's detail.import, the last `import` event's detail)."""
    started = events(build, "SELECT detail FROM events WHERE kind = 'run_started' ORDER BY seq DESC LIMIT 1")
    done = events(build, "SELECT detail FROM events WHERE kind = 'import' ORDER BY seq DESC LIMIT 1")
    return json.loads(started[0]["detail"])["import"], json.loads(done[0]["detail"])


# -- 1. the incident ----------------------------------------------------------------------------------------
def test_incident_old_dump_imported_the_gaps_extracted_and_all_bit_exact(source, tmp_path, cli):
    """An old SpecForge dump with 3 files lost, one cut short by a full disk and one right-padded by SpecForge's
    batching: the import takes every usable file (padding stripped), lists the cut one, `resume` extracts
    exactly the 4 samples without a usable file, and the build equals a build extracted from scratch."""
    dump = tmp_path / "old-dump"
    shutil.copytree(source.root / "specforge", dump)
    (dump / JOURNAL).unlink()  # SpecForge's own dumps keep no record of their layers: the user says which
    sid_of = by_tokens(source.rows)
    file_of = {sid_of[tuple(torch.load(p, weights_only=True)["input_ids"].tolist())]: p
               for p in dump.rglob("data_*.ckpt")}
    assert sorted(file_of) == sorted(sid_of.values())
    sids = sorted(file_of)
    deleted, truncated, padded = {sids[1], sids[6], sids[11]}, sids[3], sids[8]
    for sid in deleted:
        file_of[sid].unlink()
    raw = file_of[truncated].read_bytes()
    file_of[truncated].write_bytes(raw[: len(raw) // 2])
    d = torch.load(file_of[padded], weights_only=True)
    n, k = d["input_ids"].shape[0], 7
    g = torch.Generator().manual_seed(0)
    d["input_ids"] = torch.cat([d["input_ids"], torch.zeros(k, dtype=torch.long)])
    d["loss_mask"] = torch.cat([d["loss_mask"], torch.zeros(k, dtype=torch.long)])
    d["aux_hidden_state"] = torch.cat([d["aux_hidden_state"],
                                       torch.randn(1, k, N_AUX * H, generator=g).to(torch.bfloat16)], dim=1)
    d["hidden_state"] = torch.cat([d["hidden_state"], torch.randn(1, k, H, generator=g).to(torch.bfloat16)], dim=1)
    torch.save(d, file_of[padded])
    assert torch.load(file_of[padded], weights_only=True)["input_ids"].shape[0] == n + k
    before = sha256_tree(dump)

    b = tmp_path / "b"
    cli("init", b, "--source", source.src, "--model", MODEL, "--final-state", "post_norm", *WM, check=True)
    cp = cli("import", b, dump, "--format", "specforge", "--dump-layers", DECODER_IDS, "--no-progress")
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert f"dump layers: {DECODER_IDS} (decoder_layer_output ids, from --dump-layers), the build's" in cp.stdout
    assert "Traceback" not in cp.stderr
    imported = set(sids) - deleted - {truncated}
    assert f"imported {len(imported)} sample(s) from {N - 3} file(s); 1 file(s) unusable" in cp.stdout, cp.stdout
    bad = table(cp.stdout)
    assert len(bad) == 1, cp.stdout
    assert bad[0].startswith(str(file_of[truncated]) + " "), bad[0]
    reason = bad[0][len(str(file_of[truncated])):].split()[0]  # checked last: the rest of the story first
    assert f"hsbuild resume {b}" in cp.stdout

    # `hsbuild sql`: every imported sample is written, its event naming its file in the dump
    cp = cli("sql", b, "SELECT sample_id, json_extract_string(detail, '$.import.file') AS file, "
                       "json_extract_string(detail, '$.import.format') AS format FROM events "
                       "WHERE kind = 'written' ORDER BY sample_id", "--json", check=True)
    written = {r["sample_id"]: (r["file"], r["format"]) for r in json.loads(cp.stdout)}
    assert written == {sid: (str(file_of[sid]), "specforge") for sid in imported}
    assert padded in written  # the padding was stripped off, not a mismatch
    states = sample_states(b)
    assert {s for s, st in states.items() if st == "written"} == imported
    assert {s for s, st in states.items() if st != "written"} == deleted | {truncated}
    assert_same_states(b, source.states, {padded})  # the pad rows are gone: n tokens, A's states

    # resume extracts exactly the samples without a usable file
    cp = cli("resume", b, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    started = started_in(b, last_run(b))
    assert set(started) == deleted | {truncated}
    assert all(r["origin"] is None for r in started.values())  # forward passes, not imports
    assert set(sample_states(b).values()) == {"written"}
    prov = provenance(b)
    assert all(prov[sid] == (None, None) for sid in deleted | {truncated})
    cp = cli("verify", b)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert_same_states(b, source.states)  # every sample, imported or extracted, equals A's bit for bit
    assert len(states_of(b)) == N
    assert sha256_tree(dump) == before  # the dump was only read
    # a .ckpt cut in half by a full disk is `truncated` (not merely `unreadable`): the report tells the user
    # the file is incomplete, so re-running the producer (not debugging the format) is the fix
    assert reason == "truncated", bad[0]


# -- 2. planted faults --------------------------------------------------------------------------------------
def test_planted_faults_are_reported_with_their_reason_and_left_for_the_next_run(source, tmp_path):
    """modelopt files with one fault each: the right reason for each, the good files imported, and the next
    run extracts exactly the faulty ones even with --max-attempts 1 and two failed imports behind them."""
    dump = tmp_path / "faulty"
    shutil.copytree(source.root / "modelopt", dump)
    sids = sorted(source.states)
    path = {sid: dump / f"{sid}.pt" for sid in sids}
    assert all(p.is_file() for p in path.values())

    def rewrite(sid: str, change) -> None:
        d = torch.load(path[sid], weights_only=True)
        change(d)
        torch.save(d, path[sid])

    shape, nan, tokens, dtype, keys, empty = sids[1], sids[2], sids[3], sids[4], sids[5], sids[6]
    rewrite(shape, lambda d: d.update(aux_hidden_states=d["aux_hidden_states"][:, : (N_AUX - 1) * H].clone()))

    def put_nan(d):
        d["hidden_states"][d["hidden_states"].shape[0] // 2, 5] = float("nan")

    rewrite(nan, put_nan)

    def other_tokens(d):
        d["input_ids"][2] = 3 + (int(d["input_ids"][2]) - 3 + 1) % 1000  # one token off: no source row

    rewrite(tokens, other_tokens)
    rewrite(dtype, lambda d: d.update(aux_hidden_states=d["aux_hidden_states"].float(),
                                      hidden_states=d["hidden_states"].float()))
    rewrite(keys, lambda d: d.pop("aux_hidden_states"))
    path[empty].write_bytes(b"")
    faulty = {shape, nan, tokens, dtype, keys, empty}
    good = set(sids) - faulty
    before = sha256_tree(dump)

    b = new_build(tmp_path, source, "b", max_attempts=1)
    rep = run_build(b, imports(dump, "modelopt"), echo=quiet)
    assert rep.dump is not None and rep.dump.scanned == N
    # files whose tokens do not read or match no sample: found while matching (named by their file name)
    assert sorted((Path(p.path).name, p.reason, p.sample_id) for p in rep.dump.problems) == sorted([
        (f"{tokens}.pt", "token_mismatch", tokens), (f"{empty}.pt", "truncated", empty)])
    # the others: refused by the worker's full check
    got = {r["sample_id"]: (r["reason"], r["path"]) for r in rep.rejected}
    assert got == {shape: ("bad_shape", str(path[shape])), nan: ("nonfinite", str(path[nan])),
                   dtype: ("bad_dtype", str(path[dtype])), keys: ("bad_keys", str(path[keys]))}
    assert all(r["message"] for r in rep.rejected)
    assert rep.written == len(good)
    assert {sid for sid, st in sample_states(b).items() if st == "written"} == good
    assert {sid: f for sid, (f, _) in provenance(b).items()} == {sid: str(path[sid]) for sid in good}
    ev = events(b, "SELECT detail FROM events WHERE kind = 'import'")
    assert len(ev) == 1
    detail = json.loads(ev[0]["detail"])
    assert detail["format"] == "modelopt" and detail["imported"] == len(good)
    # the export's journal said which layers the dump holds (modelopt's numbering: decoder layers)
    assert detail["dump_layers"] == {"layers": [0, 1, 2], "convention": "decoder_layer_output", "source": "dump",
                                     "metadata": str(dump / JOURNAL)}
    assert {u["reason"] for u in detail["unusable"]} == {"token_mismatch", "truncated"}
    assert {r["reason"] for r in detail["rejected"]} == {"bad_shape", "nonfinite", "bad_dtype", "bad_keys"}
    assert_same_states(b, source.states, good)

    # the same import again: the good files are not read again, the faulty ones fail again (a 2nd import start)
    rep = run_build(b, imports(dump, "modelopt"), echo=quiet)
    assert rep.written == 0 and {r["sample_id"] for r in rep.rejected} == {shape, nan, dtype, keys}
    started = started_in(b, last_run(b))
    assert set(started) == {shape, nan, dtype, keys} and {r["origin"] for r in started.values()} == {"import"}

    # an ordinary run (--max-attempts 1 from init): import starts are no attempts, every faulty sample extracted
    rep = run_build(b, RunOptions(workers=1), echo=quiet)
    assert (rep.outcome, rep.exit_code, rep.written, rep.failed) == ("completed", 0, len(faulty), 0)
    started = started_in(b, last_run(b))
    assert set(started) == faulty and all(r["origin"] is None for r in started.values())
    assert {sid: r["attempt"] for sid, r in started.items()} == {
        **{sid: 3 for sid in (shape, nan, dtype, keys)}, tokens: 1, empty: 1}
    assert set(sample_states(b).values()) == {"written"}
    assert_same_states(b, source.states)
    assert sha256_tree(dump) == before


# -- 3. resumable / idempotent, and the final state's convention -----------------------------------------------
def test_import_twice_imports_nothing_the_second_time_and_pre_norm_dumps_become_post_norm(source, tmp_path, cli):
    """A speculators dump (pre-norm final states) imported into a post-norm build: post-norm derived with the
    build's final norm, bit-exact to a post-norm build extracted directly; importing it again imports nothing
    and exits 0."""
    pre = new_build(tmp_path, source, "pre", final_state="pre_norm")
    assert run_build(pre, RunOptions(workers=1), echo=quiet).written == N
    dump = tmp_path / "speculators"
    assert export_build(pre, dump, ExportOptions(format="speculators")).exported == N
    before = sha256_tree(dump)

    b = new_build(tmp_path, source, "b")
    rep = run_build(b, imports(dump, "speculators"), echo=quiet)
    assert (rep.outcome, rep.exit_code, rep.written) == ("completed", 0, N)
    assert rep.dump.problems == [] and rep.rejected == []
    assert rep.dump.claim.as_dict() == {"layers": [1, 2, 3], "convention": "vllm_eagle_aux_hidden_state_layer_ids",
                                        "source": "dump", "metadata": str(dump / JOURNAL)}  # vLLM's numbering
    assert_same_states(b, source.states)  # A is the post-norm build of the same source and model
    assert {fmt for _, fmt in provenance(b).values()} == {"speculators"}

    cp = cli("import", b, dump, "--format", "speculators", "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "imported 0 sample(s)" in cp.stdout and "0 file(s) unusable" in cp.stdout
    assert f"{N} sample(s) matched ({N} already in the build)" in cp.stderr and "0 to import now" in cp.stderr
    assert started_in(b, last_run(b)) == {}
    assert len(events(b, "SELECT seq FROM events WHERE kind = 'written'")) == N  # nothing written twice
    assert sha256_tree(dump) == before


def test_post_norm_dump_into_a_pre_norm_build_is_refused_whole(source, tmp_path):
    """The norm cannot be undone: a SpecForge dump (post-norm) into a pre-norm build is refused before any file
    is read: nothing written, no sample touched, the dump unchanged."""
    b = new_build(tmp_path, source, "b", final_state="pre_norm")
    dump = source.root / "specforge"
    before = sha256_tree(dump)
    with pytest.raises(UsageError, match="--final-state post_norm"):
        run_build(b, imports(dump, "specforge"), echo=quiet)
    assert set(sample_states(b).values()) <= {"pending"}
    assert sha256_tree(dump) == before


@pytest.mark.parametrize("fmt,compress", [("specforge", None), ("specforge", 1), ("speculators", None),
                                          ("modelopt", None), ("pt", None)],
                         ids=["specforge", "specforge-gz", "speculators", "modelopt", "pt"])
def test_a_file_cut_short_is_reported_truncated_in_every_format(source, tmp_path, fmt, compress):
    """Each format's file, whole beside one cut in half (a full disk, a killed copy): the whole one is matched,
    the cut one is listed `truncated`. (--limit 0: the files are matched, nothing is imported.)"""
    writer = make_format("specforge" if fmt == "pt" else fmt, compress=compress)
    sids = sorted(source.states)[:2]
    dump = tmp_path / "dump"
    written = {}
    for index, sid in enumerate(sids):
        it = source.states[sid]
        s = TrainerSample(sid, index, index, it["input_ids"], it["loss_mask"], it["aux_hidden_state"],
                          it["hidden_state"])
        rel, data = writer.sample_path(index, sid), writer.sample_bytes(s)
        if fmt == "pt":
            rel = f"sample_{index}.pt"
        (dump / rel).parent.mkdir(parents=True, exist_ok=True)
        (dump / rel).write_bytes(data)
        written[sid] = dump / rel
    whole, cut = sids
    raw = written[cut].read_bytes()
    written[cut].write_bytes(raw[: len(raw) // 2])
    b = new_build(tmp_path, source, "b")
    layers = [1, 2, 3] if fmt == "speculators" else [0, 1, 2]  # its own numbering: vLLM ids, else decoder layers
    rep = run_build(b, RunOptions(limit=0, imports=ImportOptions(str(dump), fmt, dump_layers=layers)), echo=quiet)
    assert rep.written == 0 and rep.dump.scanned == 2
    assert rep.dump.files == {whole: str(written[whole])}
    assert [(p.path, p.reason) for p in rep.dump.problems] == [(str(written[cut]), "truncated")], \
        rep.dump.problems


# -- 4. a home-grown script's dump --------------------------------------------------------------------------
def write_script_dump(root: Path, states: dict[str, dict], sids: list[str]) -> dict[str, Path]:
    """torch.save dicts as a home-grown script writes them: named by its own numbering (not the sample's),
    spread over shard folders, beside files that are no samples."""
    out = {}
    order = list(reversed(sids))  # the script's numbering is not the source's
    for j, sid in enumerate(order):
        it = states[sid]
        p = root / f"shard_{j % 3}" / f"sample_{j:04d}.pt"
        p.parent.mkdir(parents=True, exist_ok=True)
        rec = {"input_ids": it["input_ids"].clone(), "aux_hidden_states": it["aux_hidden_state"].clone(),
               "hidden_states": it["hidden_state"].clone()}
        if j % 4 == 1:  # some scripts keep the batch axis and call the tokens token_ids
            rec = {"token_ids": rec["input_ids"][None], "aux_hidden_states": rec["aux_hidden_states"][None],
                   "hidden_states": rec["hidden_states"][None]}
        torch.save(rec, p)
        out[sid] = p
    (root / "README.txt").write_text("hidden states, made by extract.py\n")
    (root / "shard_0" / "config.json").write_text("{}")
    return out


def test_plain_pt_dump_of_a_home_grown_script_imports_bit_exact(source, tmp_path, cli):
    dump = tmp_path / "script-dump"
    files = write_script_dump(dump, source.states, sorted(source.states))
    before = sha256_tree(dump)
    b = new_build(tmp_path, source, "b")
    cp = cli("import", b, dump, "--format", "pt", "--dump-layers", DECODER_IDS, "--no-progress")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"imported {N} sample(s) from {N} file(s); 0 file(s) unusable" in cp.stdout
    assert provenance(b) == {sid: (str(p), "pt") for sid, p in files.items()}
    assert_same_states(b, source.states)
    cp = cli("verify", b)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert sha256_tree(dump) == before


def test_a_relative_dump_dir_is_recorded_as_an_absolute_path(source, tmp_path, cli):
    """`hsbuild import B dump` from the dump's parent: each `written` event must name its file so that it can
    be found again from anywhere (the `run_started`/`import` events record the dir absolute too)."""
    sids = sorted(source.states)[:3]
    dump = tmp_path / "rel"
    files = write_script_dump(dump, source.states, sids)
    b = new_build(tmp_path, source, "b")
    cp = cli("import", b, "rel", "--format", "pt", "--dump-layers", DECODER_IDS, "--no-progress", cwd=tmp_path)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    ev = json.loads(events(b, "SELECT detail FROM events WHERE kind = 'import'")[0]["detail"])
    assert Path(ev["dir"]).is_absolute() and Path(ev["dir"]).resolve() == dump.resolve()
    recorded = {sid: f for sid, (f, _) in provenance(b).items()}
    assert set(recorded) == set(files)
    for sid, f in recorded.items():
        assert Path(f).is_absolute(), f"{sid}: its file is recorded as {f!r}, relative to the importer's cwd"
        assert Path(f).resolve() == files[sid].resolve()


# -- 5. bad usage -------------------------------------------------------------------------------------------
def test_bad_usage_exits_2_with_one_line_and_changes_nothing(source, tmp_path, cli):
    b = new_build(tmp_path, source, "b")
    seq = events(b, "SELECT max(seq) AS n FROM events")[0]["n"]

    missing = tmp_path / "no-such-dump"
    cp = cli("import", b, missing, "--format", "specforge", "--dump-layers", DECODER_IDS, "--no-progress")
    lines = cp.stderr.strip().splitlines()
    assert cp.returncode == 2 and len(lines) == 1, cp.stderr
    assert str(missing) in lines[0] and lines[0].startswith("hsbuild import: error:")

    empty = tmp_path / "empty-dump"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing here\n")
    (empty / "x.pt").write_bytes(b"not specforge's")
    cp = cli("import", b, empty, "--format", "specforge", "--dump-layers", DECODER_IDS, "--no-progress")
    lines = cp.stderr.strip().splitlines()
    assert cp.returncode == 2 and len(lines) == 1, cp.stderr
    assert str(empty) in lines[0] and "specforge" in lines[0] and "Traceback" not in cp.stderr

    cp = cli("import", b, empty, "--format", "nope", "--no-progress")
    assert cp.returncode == 2 and "--format" in cp.stderr and "nope" in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr

    assert events(b, "SELECT max(seq) AS n FROM events")[0]["n"] == seq  # no run was recorded
    assert set(sample_states(b).values()) <= {"pending"}


# -- 6. which layers the dump holds ---------------------------------------------------------------------------
def test_a_dump_of_other_layers_of_the_same_width_is_refused_whole(source, tmp_path, cli):
    """A's dumps hold hidden_states 1, 2, 3; build B keeps 0, 1, 2: as wide, other layers. Told by the flag (a
    SpecForge dump keeps no record) or by the dump's own journal, the import is refused before anything is
    written: exit 4, one line naming both lists; no sample written, not even a run started; the dump unchanged.
    A flag cannot talk the dump's own journal out of what it says."""
    b = new_build(tmp_path, source, "b", aux_layers=[0, 1, 2])
    assert BuildInfo.load(layout(b)).layer_ids()["decoder_layer_output"][:-1] == [-1, 0, 1]
    bare = tmp_path / "bare"
    shutil.copytree(source.root / "specforge", bare)
    (bare / JOURNAL).unlink()
    seq = events(b, "SELECT max(seq) AS n FROM events")[0]["n"]
    data = sha256_tree(layout(b).data)
    journal = source.root / "specforge" / JOURNAL
    for dump, flags, said in ((bare, ["--dump-layers", DECODER_IDS], "from --dump-layers"),
                              (source.root / "specforge", [], f"from {journal}"),
                              (source.root / "specforge", ["--dump-layers=-1,0,1"], f"from {journal}")):
        before = sha256_tree(dump)
        cp = cli("import", b, dump, "--format", "specforge", *flags, "--no-progress")
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 4 and len(lines) == 1, (flags, cp.stdout + cp.stderr)
        assert lines[0].startswith("hsbuild import: error:") and "Traceback" not in cp.stderr
        assert f"aux layers {DECODER_IDS} (decoder_layer_output ids, {said}" in lines[0], lines[0]
        assert "the build -1,0,1 (decoder_layer_output ids)" in lines[0], lines[0]
        assert f"--aux-layers {HF_IDS}" in lines[0]  # the build the dump belongs in
        assert cp.stdout == ""
        assert sha256_tree(dump) == before
    assert events(b, "SELECT max(seq) AS n FROM events")[0]["n"] == seq  # no run, no `written`, nothing at all
    assert set(sample_states(b).values()) == {"pending"}
    assert sha256_tree(layout(b).data) == data

    # the same through the API: the typed refusal, exit code 4
    with pytest.raises(DumpRefused) as err:
        run_build(b, imports(bare, "specforge", [0, 1, 2]), echo=quiet)
    assert err.value.exit_code == 4


def test_missing_dump_layers_without_metadata_is_refused_in_one_line_naming_the_flag(source, tmp_path, cli):
    """No journal, no --dump-layers: never guessed. Exit 2, one line naming the flag and the build's layers in
    the format's numbering (speculators: vLLM ids; pt: decoder layers), nothing recorded."""
    b = new_build(tmp_path, source, "b")
    seq = events(b, "SELECT max(seq) AS n FROM events")[0]["n"]
    dump = tmp_path / "script-dump"
    write_script_dump(dump, source.states, sorted(source.states)[:2])
    for fmt, ids, conv in (("pt", DECODER_IDS, "decoder_layer_output"),
                           ("speculators", HF_IDS, "vllm_eagle_aux_hidden_state_layer_ids")):
        cp = cli("import", b, dump, "--format", fmt, "--no-progress")
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 2 and len(lines) == 1, cp.stdout + cp.stderr
        assert lines[0].startswith(f"hsbuild import: error: {dump}: the dump does not say which layers"), lines[0]
        assert f"--dump-layers {ids} if it holds the build's aux layers ({conv} ids, {fmt}'s numbering" in lines[0]
        assert "--dump-layer-convention" in lines[0]
    # a flag of its own malformed: one line naming it
    for flags, named in ((["--dump-layers", "1,x"], "--dump-layers"), (["--dump-layers", "0,0,1"], "--dump-layers"),
                         (["--dump-layers", "-2,0,1"], "--dump-layers"),
                         (["--dump-layers", "0,1,2", "--dump-layer-convention", "mine"], "--dump-layer-convention")):
        cp = cli("import", b, dump, "--format", "pt", *flags, "--no-progress")
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 2 and len(lines) == 1 and named in lines[0], (flags, cp.stderr)
    assert events(b, "SELECT max(seq) AS n FROM events")[0]["n"] == seq
    # an hsbuild export's journal that does not read: refused, never passed over
    dump = tmp_path / "torn-journal"
    shutil.copytree(source.root / "modelopt", dump)
    (dump / JOURNAL).write_text('{"hsbuild_export": 1, "layer_')
    cp = cli("import", b, dump, "--format", "modelopt", "--dump-layers", DECODER_IDS, "--no-progress")
    assert cp.returncode == 2 and str(dump / JOURNAL) in cp.stderr and "--dump-layers" in cp.stderr, cp.stderr
    assert events(b, "SELECT max(seq) AS n FROM events")[0]["n"] == seq


@pytest.mark.parametrize("conv,ids,ok", [(None, [0, 1, 2], True), ("decoder", [0, 1, 2], True),
                                         ("decoder_layer_output", [0, 1, 2], True), ("hf", [1, 2, 3], True),
                                         ("hf_hidden_states", [1, 2, 3], True), ("vllm", [1, 2, 3], True),
                                         ("hf", [0, 1, 2], False), (None, [1, 2, 3], False),
                                         (None, [2, 1, 0], False), (None, [0, 1], False)],
                         ids=["default", "decoder", "decoder-full", "hf", "hf-full", "vllm", "hf-off-by-one",
                              "decoder-off-by-one", "reordered", "too-few"])
def test_the_convention_flag_converts_the_claim(source, tmp_path, conv, ids, ok):
    """The same layers given in any numbering pass, and are recorded as given; the decoder ids read as HF ids
    (and vice versa), another order or count are other layers: refused. (--limit 0: the claim is checked and
    recorded, nothing imported.)"""
    dump = tmp_path / "script-dump"
    write_script_dump(dump, source.states, sorted(source.states)[:2])
    b = new_build(tmp_path, source, "b")
    if not ok:
        with pytest.raises(DumpRefused, match="not this build's layers") as err:
            run_build(b, imports(dump, "pt", ids, conv, limit=0), echo=quiet)
        assert err.value.exit_code == 4
        assert set(sample_states(b).values()) == {"pending"}
        return
    rep = run_build(b, imports(dump, "pt", ids, conv, limit=0), echo=quiet)
    full = CONVENTIONS.get(conv, conv) or "decoder_layer_output"
    want = {"layers": ids, "convention": full, "source": "flag"}
    assert rep.dump.claim.as_dict() == want and len(rep.dump.files) == 2
    started, done = import_details(b)
    assert started["dump_layers"] == want and done["dump_layers"] == want


@pytest.mark.parametrize("cut", ["aux", "final"])
def test_a_dump_of_another_width_is_refused_whole(source, tmp_path, cli, cut):
    """A dump whose states are narrower than the build's (two aux layers, or a model of half the hidden size),
    its layers claimed as the build's: refused as a whole before anything is written (exit 4, one line naming
    both widths), not as one `bad_shape` a file; the dump unchanged."""
    dump = tmp_path / "narrow"
    files = write_script_dump(dump, source.states, sorted(source.states)[:5])
    for p in files.values():
        d = torch.load(p, weights_only=True)
        key = "aux_hidden_states" if cut == "aux" else "hidden_states"
        keep = (N_AUX - 1) * H if cut == "aux" else H // 2
        d[key] = d[key][..., :keep].clone()
        torch.save(d, p)
    before = sha256_tree(dump)
    b = new_build(tmp_path, source, "b")
    seq = events(b, "SELECT max(seq) AS n FROM events")[0]["n"]
    cp = cli("import", b, dump, "--format", "pt", "--dump-layers", DECODER_IDS, "--no-progress")
    lines = cp.stderr.strip().splitlines()
    assert cp.returncode == 4 and len(lines) == 1, cp.stdout + cp.stderr
    a, f = ((N_AUX - 1) * H, H) if cut == "aux" else (N_AUX * H, H // 2)
    assert f"its states are {a} (aux) and {f} (final) wide" in lines[0], lines[0]
    assert f"the build holds {N_AUX} aux layers of hidden size {H}: {N_AUX * H} and {H}" in lines[0], lines[0]
    assert "nothing imported" in lines[0] and "Traceback" not in cp.stderr
    assert events(b, "SELECT max(seq) AS n FROM events")[0]["n"] == seq
    assert "written" not in set(sample_states(b).values())
    assert sha256_tree(dump) == before


def test_the_claim_is_recorded_in_the_run_and_shown_in_the_report(source, tmp_path, cli):
    """run_started's `import`, the final `import` event, the text report and --json all carry the claim."""
    dump = tmp_path / "script-dump"
    write_script_dump(dump, source.states, sorted(source.states)[:3])
    b = new_build(tmp_path, source, "b")
    cp = cli("import", b, dump, "--format", "pt", "--dump-layers", HF_IDS, "--dump-layer-convention", "hf",
             "--no-progress", "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    want = {"layers": [1, 2, 3], "convention": "hf_hidden_states", "source": "flag"}
    out = json.loads(cp.stdout)
    assert out["dump_layers"] == want and out["imported"] == 3
    started, done = import_details(b)
    assert started["dump_layers"] == want and done["dump_layers"] == want
    assert {f for f, _ in provenance(b).values()} == {str(p) for p in dump.rglob("sample_*.pt")}
    assert_same_states(b, source.states, set(provenance(b)))


def test_the_imports_numberings_are_the_builds(source, tmp_path):
    """The import checks claims in BuildInfo.layer_ids()'s numberings (the build's metadata read its own way),
    and --dump-layer-convention offers exactly their keys and short names."""
    from builder.cli.exchange import LAYER_CONVENTIONS  # noqa: PLC0415

    for b in (source.a, new_build(tmp_path, source, "b", aux_layers=[0, 3, 2])):
        want = BuildInfo.load(layout(b)).layer_ids()
        assert BuildGeometry.load(layout(b)).layer_ids() == want
    assert set(CONVENTIONS.values()) == set(want)
    assert set(LAYER_CONVENTIONS) == set(want) | set(CONVENTIONS)


# -- 6. several files with the same tokens ----------------------------------------------------------------------
def test_conflicting_files_are_both_refused_and_identical_ones_imported_once(source, tmp_path, cli):
    """A modelopt dump with two extra files: one holding the same tokens and states as a sample's own file
    (saved again: other bytes, the same states), one holding the same tokens as another sample's file with one
    state changed. The identical pair imports once (the other file listed `duplicate`); the conflicting pair
    imports neither (both listed `conflict`, each naming the other) and `resume` extracts that sample."""
    dump = tmp_path / "dups"
    shutil.copytree(source.root / "modelopt", dump)
    sids = sorted(source.states)
    dup, conf = sids[2], sids[5]
    (dump / "extra").mkdir()
    same, other = dump / "extra" / "again.pt", dump / "extra" / "changed.pt"
    torch.save(torch.load(dump / f"{dup}.pt", weights_only=True), same)
    d = torch.load(dump / f"{conf}.pt", weights_only=True)
    d["hidden_states"][1, 3] = d["hidden_states"][1, 3] + 1  # one value of one token's final state
    torch.save(d, other)
    assert same.read_bytes() != (dump / f"{dup}.pt").read_bytes()
    before = sha256_tree(dump)

    b = new_build(tmp_path, source, "b")
    cp = cli("import", b, dump, "--format", "modelopt", "--no-progress")
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert f"imported {N - 1} sample(s) from {N + 2} file(s); 2 file(s) unusable" in cp.stdout, cp.stdout
    rows = sorted(table(cp.stdout))
    assert len(rows) == 2, cp.stdout
    for row, path in zip(rows, sorted([str(dump / f"{conf}.pt"), str(other)]), strict=True):
        assert row.startswith(path + " ") and row[len(path):].split()[:2] == [conf, "conflict"], row
    dup_line = next(line for line in cp.stdout.splitlines() if "duplicate file(s)" in line)
    assert dup_line.startswith("1 duplicate file(s) not imported"), dup_line
    assert "Traceback" not in cp.stderr

    # neither conflicting file is committed; the duplicated sample once, from one of its two files
    prov = provenance(b)
    assert conf not in prov and set(prov) == set(sids) - {conf}
    assert prov[dup][0] in {str(same), str(dump / f"{dup}.pt")}
    assert len(events(b, "SELECT seq FROM events WHERE kind = 'written' AND sample_id = ?", [dup])) == 1
    assert sample_states(b)[conf] == "pending"
    _, done = import_details(b)
    unusable = {u["path"]: u for u in done["unusable"]}
    assert set(unusable) == {str(dump / f"{conf}.pt"), str(other)}
    for path, u in unusable.items():
        others = set(unusable) - {path}
        assert (u["reason"], u["sample_id"]) == ("conflict", conf) and others.pop() in u["message"], u
    assert [(x["reason"], x["sample_id"]) for x in done["duplicates"]] == [("duplicate", dup)]
    assert {done["duplicates"][0]["path"], prov[dup][0]} == {str(same), str(dump / f"{dup}.pt")}
    assert_same_states(b, source.states, set(prov))

    # the sample is left for extraction: the next run extracts exactly it, and the build equals A
    rep = run_build(b, RunOptions(workers=1), echo=quiet)
    assert (rep.outcome, rep.exit_code, rep.written) == ("completed", 0, 1)
    assert set(started_in(b, last_run(b))) == {conf}
    assert_same_states(b, source.states)
    assert sha256_tree(dump) == before


def test_identical_duplicates_alone_are_no_error(source, tmp_path, cli):
    """A script's dump with a second copy of one file: imported once, the copy reported `duplicate`, exit 0."""
    dump = tmp_path / "script-dump"
    files = write_script_dump(dump, source.states, sorted(source.states)[:3])
    sid, path = next(iter(files.items()))
    copy = dump / "zz-copy" / path.name
    copy.parent.mkdir()
    shutil.copy(path, copy)
    b = new_build(tmp_path, source, "b")
    cp = cli("import", b, dump, "--format", "pt", "--dump-layers", DECODER_IDS, "--no-progress", "--json")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = json.loads(cp.stdout)
    assert out["imported"] == 3 and out["unusable"] == []
    assert [(d["path"], d["sample_id"]) for d in out["duplicates"]] == [(str(copy), sid)]
    assert str(path) in out["duplicates"][0]["message"]
    assert provenance(b)[sid] == (str(path), "pt")  # the first in the dump's order


def test_settle_compares_states_only_over_the_samples_tokens(tmp_path):
    """`settle` without a run: SpecForge-style padding past the sample's tokens is no difference, one changed
    bit is; a file that does not load is that file's own problem and takes no part."""
    from builder.exchange.imports import DumpIndex, settle  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    n = 9
    ids = torch.arange(3, 3 + n)
    aux = torch.randn(n, N_AUX * H, generator=g).to(torch.bfloat16)
    final = torch.randn(n, H, generator=g).to(torch.bfloat16)

    def save(name: str, ids=ids, aux=aux, final=final) -> str:
        p = tmp_path / name
        torch.save({"input_ids": ids, "aux_hidden_states": aux, "hidden_states": final}, p)
        return str(p)

    plain = save("a.pt")
    pad = 4
    padded = save("b.pt", torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)]),
                  torch.cat([aux, torch.randn(pad, N_AUX * H, generator=g).to(torch.bfloat16)]),
                  torch.cat([final, torch.randn(pad, H, generator=g).to(torch.bfloat16)]))
    flipped = final.clone()
    flipped.view(torch.int16)[4, 7] ^= 1  # one bit of one value
    changed = save("c.pt", final=flipped)
    cut = tmp_path / "d.pt"
    cut.write_bytes(Path(plain).read_bytes()[:100])
    fmt = make_format("pt")

    out = DumpIndex()
    assert settle(fmt, ("s",), [plain, padded, str(cut)], n, out) == plain
    assert [(p.path, p.reason) for p in out.duplicates] == [(padded, "duplicate")]
    assert [(p.path, p.reason, p.sample_id) for p in out.problems] == [(str(cut), "truncated", "s")]

    out = DumpIndex()
    assert settle(fmt, ("s", "t"), [plain, padded, changed], n, out) is None
    assert out.duplicates == []
    assert [(p.path, p.reason, p.sample_id) for p in out.problems] == [
        (plain, "conflict", "s"), (padded, "conflict", "s"), (changed, "conflict", "s")]
    assert all(changed in p.message for p in out.problems[:2]) and plain in out.problems[2].message


def test_a_post_norm_dump_into_a_pre_norm_build_is_refused_at_once(make_build, cli, tmp_path):
    """New builds store the pre-norm final state; SpecForge and Model-Optimizer dumps hold the post-norm one,
    which cannot be undone: refused in one line naming the flag that makes a build for them, before any file is
    read (instead of every file failing `bad_final_state`)."""
    build = make_build(3, final_state="pre_norm")
    dump = tmp_path / "dump"
    dump.mkdir()
    for fmt in ("specforge", "modelopt"):
        cp = cli("import", build, dump, "--format", fmt, "--dump-layers", "0,1,2", "--no-progress")
        err = cp.stderr.strip().splitlines()
        assert cp.returncode == 2 and len(err) == 1, cp.stderr
        assert "--final-state post_norm" in err[0] and fmt in err[0], err
