"""`hsbuild export`: what each trainer's OWN dataset class reads from the exported files is, bit for bit, the item
`HiddenStateDataset(build, format=F)` yields for the same sample; the dataset-wide files (token frequencies, the
reduced draft vocabulary) are what the trainers compute themselves; the export survives a SIGKILL, never writes
a damaged sample, partitions with --subset/--limit, is recorded in the build's log, respects the target volume's
watermarks (a real tmpfs, root only), and what it calls complete survives a power cut (lazyfs, --dirs strict).

Real builds (the small built-in model), real trainer code (SpecForge 0.2.0, speculators 0.9.0, Model-Optimizer
0.47.0, CPU only), the real CLI in subprocesses. A test whose trainer does not import is skipped, naming the
install.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import forked
import numpy as np
import pytest
import torch
from conftest import ROOMY, hsbuild, random_rows, write_jsonl

from builder.config import Watermarks
from builder.errors import FormatError, UsageError, WontFitError
from builder.exchange.export import JOURNAL, TMP_SUFFIX, ExportOptions, export_build
from builder.formats.build_info import BuildInfo
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store.segment import field_geometry, sample_files
from builder.store.shard import read_index

MODEL = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
VOCAB = 1024
D = 64  # the reduced draft vocabulary: fewer than the distinct loss-masked tokens, so ties at the cut matter
MAX_LEN = 40  # shorter than most samples (random_rows: 5..119 tokens)
INSTALL = ("pip install -e .[trainers] && pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 "
           "specforge==0.2.0 nvidia-modelopt==0.47.0")
DATA = re.compile(r"^rows_(\d+)-(\d+)/data_(\d+)\.ckpt(\.gz)?$")


def trainer(module: str):
    return pytest.importorskip(module, reason=f"{module} is not importable; to run the trainer checks: {INSTALL}")


def trainer_available(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# -- builds (module scope: a run costs seconds; every test exports into its own directory) ------------------------

def _made(base: Path, name: str, rows: list[dict], final_state: str) -> Path:
    src = write_jsonl(base / f"{name}-source.jsonl", rows)
    build = init_build(base / name, src, model=MODEL, watermarks=ROOMY, final_state=final_state).root
    report = run_build(build, RunOptions(workers=1), echo=lambda m: None)
    assert report.written == len(rows), report
    return build


@pytest.fixture(scope="module")
def rows40() -> list[dict]:
    return random_rows(40, seed=11)


@pytest.fixture(scope="module")
def post(tmp_path_factory, rows40) -> Path:
    """40 samples, final state after the norm (SpecForge's and Model-Optimizer's convention)."""
    base = tmp_path_factory.mktemp("post")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSBUILD_CACHE_DIR", str(base / "cache"))
        return _made(base, "post", rows40, "post_norm")


@pytest.fixture(scope="module")
def pre(tmp_path_factory, rows40) -> Path:
    """The first 16 of the same rows, final state before the norm (speculators'; post-norm derived from it)."""
    base = tmp_path_factory.mktemp("pre")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSBUILD_CACHE_DIR", str(base / "cache"))
        return _made(base, "pre", rows40[:16], "pre_norm")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(build, format, **options) -> (OUT, report): one in-process export per distinct request."""
    cache: dict = {}

    def get(build: Path, fmt: str, **kw) -> tuple[Path, object]:
        key = (str(build), fmt, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"out-{build.name}-{fmt}") / "out"
            report = export_build(build, out, ExportOptions(format=fmt, **kw))
            assert report.complete and not report.damaged and not report.not_exported, report
            assert report.exported == report.selected == report.rows and report.already == 0, report
            cache[key] = (out, report)
        return cache[key]

    return get


# -- comparing items ----------------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_item(got: object, want: dict, where: str) -> None:
    """Same keys; every tensor the same dtype, shape and bytes (bit for bit: -0.0 is not 0.0); other values equal."""
    assert isinstance(got, dict), f"{where}: the trainer returned {got!r}, not a sample"
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{where}: {k} is {type(g).__name__}"
            assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), \
                f"{where}: {k} is {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}"
            assert torch.equal(_bits(g), _bits(w)), f"{where}: {k} differs"
        else:
            assert type(g) is type(w) and g == w, f"{where}: {k} = {g!r}, expected {w!r}"


def expected_items(build: Path, fmt: str, max_len: int | None = None) -> dict[str, dict]:
    ds = HiddenStateDataset(build, format=fmt, max_len=max_len)
    return {e["sample_id"]: ds[i] for i, e in enumerate(ds.index)}


def selection(out: Path) -> list[str]:
    """The export's rows, in order (row i = file i), as its journal lists them once finished."""
    return json.loads((out / JOURNAL).read_text())["selection"]


def specforge_index(out: Path, path: str) -> int:
    m = DATA.match(Path(path).relative_to(out).as_posix())
    assert m, f"{path}: not where SpecForge's prepare_hidden_states puts a sample"
    g, g2, i, _ = m.groups()
    assert int(g) == int(i) // 2000 * 2000 and int(g2) == int(g) + 2000, path
    return int(i)


# -- the trainers' own readers ------------------------------------------------------------------------------------

def specforge_items(out: Path, max_len: int) -> dict[str, dict]:
    """SpecForge's OfflineEagle3Dataset (scripts/train_eagle3.py's offline path), keyed by sample id."""
    pre = trainer("specforge.data.preprocessing")
    ds = pre.build_offline_eagle3_dataset(str(out), max_len=max_len)
    sel = selection(out)
    return {sel[specforge_index(out, p)]: ds[i] for i, p in enumerate(ds.datapaths)}


def specforge_runtime_items(out: Path, max_len: int) -> dict[str, dict]:
    """SpecForge 0.2.0's data plane: the offline manifest reader, the feature store, the EAGLE-3 normalizer."""
    data = trainer("specforge.algorithms.eagle3.data")
    store_mod = trainer("specforge.runtime.data_plane.feature_store")
    refs = list(data.build_offline_reader(str(out), run_id="t", ttt_length=7, max_len=max_len).read())
    normalize = data.build_offline_normalizer(max_len)
    store = store_mod.LocalFeatureStore()
    sel, items = selection(out), {}
    for ref in refs:
        assert ref.feature_store_uri.startswith("file://"), ref.feature_store_uri
        raw, handle = store.get(ref, names=list(ref.feature_keys))
        try:
            items[sel[specforge_index(out, ref.feature_store_uri[len("file://"):])]] = normalize(raw)
        finally:
            store.release(handle)
    return items


def speculators_items(out: Path) -> dict[str, dict]:
    """speculators' ArrowDataset (its train CLI's dataset), keyed by sample id (row i = export index i)."""
    data = trainer("speculators.train.data")
    ds = data.ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    sel = selection(out)
    assert len(ds) == len(sel)
    return {sel[i]: ds[i] for i in range(len(ds))}


def modelopt_items(out: Path) -> dict[str, dict]:
    """Model-Optimizer's OfflineSupervisedDataset over every *.pt under OUT (as its launcher globs them)."""
    utils = trainer("modelopt.torch.speculative.eagle.utils")
    files = sorted(str(p) for p in out.rglob("*.pt"))
    ds = utils.OfflineSupervisedDataset(files, answer_only_loss=True)
    items = {}
    for i, f in enumerate(files):
        sid = unquote(Path(f).name[: -len(".pt")])
        assert torch.load(f, weights_only=True)["conversation_id"] == sid, f
        items[sid] = ds[i]
    return items


def assert_all_equal(got: dict[str, dict], want: dict[str, dict], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: samples {sorted(got)} != {sorted(want)}"
    for sid, w in want.items():
        assert_same_item(got[sid], w, f"{what} {sid}")


def assert_specforge_reads(out, build, what: str) -> None:
    """Both of SpecForge's readers (the dataset class and 0.2.0's manifest path) give the reader's items, with a
    max_len that keeps every sample and with one that cuts some."""
    for max_len in (2048, MAX_LEN):
        want = expected_items(build, "specforge", max_len=max_len)
        assert_all_equal(specforge_items(out, max_len), want, f"{what}OfflineEagle3Dataset max_len={max_len}")
        assert_all_equal(specforge_runtime_items(out, max_len), want, f"{what}OfflineManifestReader max_len={max_len}")


# -- 1. what each trainer reads is the reader's item, bit for bit -------------------------------------------------

@pytest.mark.parametrize("which", ["post", "pre"])
def test_specforge_reads_back_the_reader_items(request, which, post, exported):
    build = request.getfixturevalue(which)
    trainer("specforge.data.preprocessing")
    out, report = exported(build, "specforge", draft_vocab_size=D)
    assert report.final_state == "post_norm"
    assert report.layer_ids == BuildInfo.load(layout(build)).layer_ids()["decoder_layer_output"][:-1]
    n = len(HiddenStateDataset(build))
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.ckpt")) == \
        sorted(f"rows_0-2000/data_{i}.ckpt" for i in range(n))

    lengths = [it["input_ids"].shape[1] for it in expected_items(build, "specforge").values()]
    assert min(lengths) < MAX_LEN < max(lengths)  # max_len really truncates some samples and not others
    assert_specforge_reads(out, build, "")

    if which == "pre":  # the post-norm state derived from a pre-norm build: bit-exactly the model's own
        stored = expected_items(post, "specforge")
        for sid, it in specforge_items(out, 2048).items():
            assert torch.equal(_bits(it["target"]), _bits(stored[sid]["target"])), sid


def test_specforge_gzip_files_read_back_the_reader_items(post, exported):
    trainer("specforge.data.preprocessing")
    out, report = exported(post, "specforge", compress=6)
    files = sorted(out.rglob("data_*"))
    assert len(files) == report.exported == 40 and all(p.name.endswith(".ckpt.gz") for p in files)
    assert all(p.read_bytes()[:2] == b"\x1f\x8b" for p in files)
    assert_specforge_reads(out, post, "gzip ")


@pytest.mark.parametrize("which", ["post", "pre"])
def test_modelopt_reads_back_the_reader_items(request, which, post, exported):
    build = request.getfixturevalue(which)
    trainer("modelopt.torch.speculative.eagle.utils")
    out, report = exported(build, "modelopt", draft_vocab_size=D)
    assert report.final_state == "post_norm"
    want = expected_items(build, "modelopt")
    assert sorted(p.name for p in out.rglob("*.pt")) == sorted(f"{sid}.pt" for sid in want)  # nothing else is .pt
    got = modelopt_items(out)
    assert_all_equal(got, want, "OfflineSupervisedDataset")
    assert all(it["base_hidden_prenorm"] is False for it in got.values())
    if which == "pre":
        stored = expected_items(post, "modelopt")
        for sid, it in got.items():
            assert torch.equal(_bits(it["base_model_hidden_states"]), _bits(stored[sid]["base_model_hidden_states"]))


def test_speculators_reads_back_the_reader_items(pre, exported):
    trainer("speculators.train.data")
    out, report = exported(pre, "speculators", draft_vocab_size=D)
    assert report.final_state == "pre_norm"
    assert report.layer_ids == BuildInfo.load(layout(pre)).layer_ids()["vllm_eagle_aux_hidden_state_layer_ids"][:-1]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == \
        sorted(f"hs_{i}.safetensors" for i in range(16))
    assert_all_equal(speculators_items(out), expected_items(pre, "speculators"), "ArrowDataset")

    from datasets import load_from_disk  # the trainer's dependency: its length column is the real length

    ds = load_from_disk(str(out)).with_format(None)
    assert ds["seq_len"] == [len(x) for x in ds["input_ids"]]


# -- 2. the vocabulary ---------------------------------------------------------------------------------------------

def source_freq(rows: list[dict]) -> dict[int, int]:
    """Counted here from the source JSONL rows: every loss-masked token."""
    c: Counter[int] = Counter()
    for r in rows:
        c.update(t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
    return dict(c)


def assert_top_d(d2t: torch.Tensor, t2d: torch.Tensor, freq: dict[int, int], smaller_id: bool = True) -> None:
    """target = draft + d2t[draft]; t2d marks exactly those targets; they are the D most frequent (ties: the
    smaller id, unless `smaller_id` is False: SpecForge's rule, tests/formats/test_vocab_ties.py)."""
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (D,)
    assert t2d.dtype == torch.bool and tuple(t2d.shape) == (VOCAB,)
    targets = torch.arange(D) + d2t
    assert bool((targets[1:] > targets[:-1]).all()) and 0 <= int(targets[0]) and int(targets[-1]) < VOCAB
    assert t2d.nonzero().flatten().tolist() == targets.tolist()
    chosen = set(targets.tolist())
    rank = sorted(freq, key=lambda t: (-freq[t], t))
    assert chosen == set(rank[:D]) or not smaller_id
    assert min(freq[t] for t in chosen) >= max(freq[t] for t in freq if t not in chosen)


def test_vocabulary_files_are_what_the_trainers_compute(post, pre, rows40, exported):
    post_freq, pre_freq = source_freq(rows40), source_freq(rows40[:16])
    assert len(post_freq) > D and len(pre_freq) > D
    assert BuildInfo.load(layout(post)).vocab_size == VOCAB

    out, _ = exported(post, "specforge", draft_vocab_size=D)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert freq == post_freq and all(type(k) is int and type(v) is int for k, v in freq.items())
    vm = torch.load(out / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert set(vm) == {"d2t", "t2d"}
    assert_top_d(vm["d2t"], vm["t2d"], post_freq, smaller_id=False)  # SpecForge's ties: the token it counts first

    from builder.formats.vocab import vocab_mapping as ours

    out, _ = exported(post, "modelopt", draft_vocab_size=D)
    assert {int(k): v for k, v in json.loads((out / "token_freq.json").read_text()).items()} == post_freq
    assert torch.equal(torch.load(out / "d2t.torch", weights_only=True), ours(Counter(post_freq), D, VOCAB)[0])

    out, _ = exported(pre, "speculators", draft_vocab_size=D)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert freq == pre_freq
    d2t, t2d = np.load(out / f"d2t-{D}.npy"), np.load(out / f"t2d-{D}.npy")  # the names its train CLI looks for
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert_top_d(torch.from_numpy(d2t), torch.from_numpy(t2d), pre_freq)

    # the trainers' own functions over hsbuild's token_freq.pt give hsbuild's mapping
    vocab_mapping = trainer("speculators.train.vocab_mapping")
    s_d2t, s_t2d = vocab_mapping.build_vocab_mappings_from_distribution(freq, D, VOCAB)
    assert np.array_equal(s_d2t.numpy(), d2t) and np.array_equal(s_t2d.numpy(), t2d)
    # SpecForge derives its mapping from the exported feature files themselves (ties: its own order)
    specforge = trainer("specforge.data.preprocessing")
    counted = trainer("specforge.training.vocab_mapping").count_effective_feature_tokens(
        str(exported(post, "specforge", draft_vocab_size=D)[0]), target_vocab_size=VOCAB)
    f_d2t, f_t2d = specforge.process_token_dict_to_mappings(counted, D, VOCAB)
    assert torch.equal(f_d2t, vm["d2t"]) and torch.equal(f_t2d, vm["t2d"])

    for size in (1, D, len(pre_freq) + 5, VOCAB):  # also when fewer tokens were seen than the draft vocabulary
        a, b = ours(Counter(pre_freq), size, VOCAB)
        s_a, s_b = vocab_mapping.build_vocab_mappings_from_distribution(pre_freq, size, VOCAB)
        assert torch.equal(a, s_a) and torch.equal(b, s_b), size


# -- 3. a post-norm build cannot give speculators' pre-norm state -------------------------------------------------

def test_post_norm_build_to_speculators_is_refused(post, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FormatError, match="--final-state pre_norm"):
        export_build(post, out, ExportOptions(format="speculators"))
    with pytest.raises(FormatError, match="--final-state pre_norm"):
        HiddenStateDataset(post, format="speculators")
    assert not out.exists()

    cp = hsbuild("export", post, out, "--format", "speculators", "--no-progress")
    assert cp.returncode == 2, cp.stderr
    assert "Traceback" not in cp.stderr and cp.stdout == ""
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsbuild export: error:") and "--final-state pre_norm" in lines[0]
    assert not out.exists()


# -- 4. a SIGKILLed export continues; other options into the same OUT are refused -------------------------------

def _ckpts(out: Path) -> list[Path]:
    d = out / "rows_0-2000"
    try:
        return [d / n for n in os.listdir(d) if n.endswith(".ckpt")]
    except FileNotFoundError:
        return []


def _export_json(build: Path, out: Path, *flags: str) -> dict:
    cp = hsbuild("export", build, out, "--format", "specforge", "--no-progress", "--json", *flags)
    assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return json.loads(cp.stdout)


@pytest.mark.claim("crash")
def test_export_killed_midway_finishes_on_rerun(post, tmp_path):
    out = tmp_path / "out"
    n = len(HiddenStateDataset(post))
    proc = forked.Popen([sys.executable, "-m", "builder.cli", "export", str(post), str(out), "--format",
                             "specforge", "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(_ckpts(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the export ended by itself ({proc.returncode}) before it was killed"
    done = len(_ckpts(out))
    assert 3 <= done < n, f"killed with {done} of {n} files written"
    assert json.loads((out / JOURNAL).read_text())["complete"] is False
    (out / "rows_0-2000" / f"data_{n - 1}.ckpt{TMP_SUFFIX}").write_bytes(b"PK\x03\x04 half a file")  # a torn write

    before = sorted(p.name for p in out.rglob("*"))
    cp = hsbuild("export", post, out, "--format", "specforge", "--limit", "5", "--no-progress")
    assert cp.returncode == 2, f"exit {cp.returncode}\n{cp.stderr}"
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsbuild export: error:"), cp.stderr
    assert "--format specforge" in lines[0] and "--limit" not in lines[0], cp.stderr  # names what OUT was made with
    for other in (ExportOptions(format="specforge", compress=3), ExportOptions(format="modelopt")):
        with pytest.raises(UsageError, match="holds an export"):
            export_build(post, out, other)
    assert sorted(p.name for p in out.rglob("*")) == before  # refused: nothing touched

    second = _export_json(post, out)
    # files the journal vouched for are kept, the others (written after its last save) written again
    assert second["complete"] and second["already"] <= done
    assert second["already"] + second["exported"] == n == second["selected"] == second["rows"]
    assert not list(out.rglob("*" + TMP_SUFFIX))
    files = sorted(out.rglob("*.ckpt"))
    assert len(files) == n
    for p in files:  # whole files only: every one loads, as the trainer loads it
        d = torch.load(p, weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}, p
    if trainer_available("specforge.data.preprocessing"):
        assert_all_equal(specforge_items(out, 2048), expected_items(post, "specforge"), "after the kill")

    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}
    side = {p: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != JOURNAL}
    third = export_build(post, out, ExportOptions(format="specforge"))
    assert (third.exported, third.bytes_written, third.already, third.complete) == (0, 0, n, True)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files} == stamps  # no sample file rewritten
    assert {p: p.read_bytes() for p in side} == side  # the dataset-wide files say the same



# -- 5. a damaged sample is never exported ------------------------------------------------------------------------

def flip_byte(build: Path, row: dict, fld: str) -> None:
    """Flip one byte inside the sample's first chunk of `fld` (uncompressed chunks: it still decodes, so only the
    CRC-32C can tell), as tests/formats/test_reader.py does."""
    seg = layout(build).data / row["segment"]
    inner, shard_chunks = field_geometry(seg, fld)
    k = row["token_start"] // inner
    path = next(p for p in sample_files(seg, fld, row["token_start"], row["num_tokens"])
                if p.name.split(".")[1] == str(k // shard_chunks))
    offset = int(read_index(path, shard_chunks)[k % shard_chunks][0])
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0x40
    path.write_bytes(bytes(data))


def test_damaged_sample_is_listed_and_not_exported(make_build, tmp_path):
    rows = random_rows(6, seed=5, lo=35, hi=48)
    build = make_build(rows=rows, codec="none", chunk_tokens=16)
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 6
    good = expected_items(build, "specforge")
    with EventLog(layout(build).events, read_only=True) as log:
        flip_byte(build, log.samples("WHERE sample_id = 's0002'")[0], "hidden_state")

    out = tmp_path / "out"
    cp = hsbuild("export", build, out, "--format", "specforge", "--no-progress")
    assert cp.returncode == 1, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    assert "Traceback" not in cp.stderr
    assert "s0002" in cp.stderr and "checksum_mismatch" in cp.stderr
    assert f"hsbuild verify {build}" in cp.stderr and f"hsbuild resume {build}" in cp.stderr

    journal = json.loads((out / JOURNAL).read_text())
    sel, report = journal["selection"], journal["report"]
    assert journal["complete"] is False and report["complete"] is False and journal["finished"] is True
    assert [(d["sample_id"], d["reason"]) for d in report["damaged"]] == [("s0002", "checksum_mismatch")]
    assert [(d["sample_id"], d["state"]) for d in report["not_exported"]] == [("s0002", "damaged")]
    assert report["exported"] == report["rows"] == 5 and "s0002" not in sel and len(sel) == 5
    assert sorted(p.name for p in out.rglob("*.ckpt")) == sorted(f"data_{i}.ckpt" for i in range(5))  # dense rows
    assert not list(out.rglob("*" + TMP_SUFFIX))
    got = {sel[int(p.name[5:-5])]: torch.load(p, weights_only=True) for p in out.rglob("*.ckpt")}
    for sid, d in got.items():  # the others: exactly what was written
        w = good[sid]
        assert torch.equal(_bits(d["hidden_state"]), _bits(w["target"][0])), sid
        assert torch.equal(_bits(d["aux_hidden_state"]), _bits(w["hidden_state"][0])), sid
        assert torch.equal(d["input_ids"], w["input_ids"][0]), sid
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert freq == source_freq([r for r in rows if r["id"] != "s0002"])  # the damaged sample's tokens not counted

    with EventLog(layout(build).events, read_only=True) as log:
        (d,) = [json.loads(r["detail"]) for r in log.query_dicts("SELECT detail FROM events WHERE kind='export'")]
    assert d["damaged"] == ["s0002"] and d["complete"] is False and d["exported"] == 5


# -- 6. --subset and --limit ---------------------------------------------------------------------------------------

def test_subsets_partition_and_limit_exports_exactly_n(post, tmp_path):
    live = [e["sample_id"] for e in HiddenStateDataset(post).index]
    parts = []
    for n in (1, 2):
        out = tmp_path / f"part{n}"
        report = export_build(post, out, ExportOptions(format="modelopt", subset=f"{n}/2"))
        assert report.complete and report.exported == report.selected > 0
        parts.append([unquote(p.name[:-3]) for p in out.glob("*.pt")])
        assert sorted(parts[-1]) == sorted(selection(out))
    assert sorted(parts[0] + parts[1]) == sorted(live)  # every live sample exactly once
    assert not set(parts[0]) & set(parts[1])

    out = tmp_path / "limit"
    cp = hsbuild("export", post, out, "--format", "modelopt", "--limit", "3", "--no-progress", "--json")
    assert cp.returncode == 0, cp.stderr
    report = json.loads(cp.stdout)
    assert report["selected"] == report["exported"] == 3
    assert sorted(p.name for p in out.glob("*.pt")) == [f"{sid}.pt" for sid in live[:3]]


# -- 7. the export is in the build's log ---------------------------------------------------------------------------

def test_export_event_is_recorded(post, tmp_path):
    out = tmp_path / "out"
    report = export_build(post, out, ExportOptions(format="specforge", limit=4, draft_vocab_size=D))
    cp = hsbuild("sql", post, "SELECT run_id, detail FROM events WHERE kind='export'", "--json")
    assert cp.returncode == 0, cp.stderr
    mine = [r for r in json.loads(cp.stdout) if json.loads(r["detail"])["out"] == str(out.absolute())]
    assert len(mine) == 1, cp.stdout
    assert mine[0]["run_id"] == report.export_id
    d = json.loads(mine[0]["detail"])
    assert d["format"] == "specforge" and d["selected"] == d["exported"] == 4 and d["already"] == 0
    assert d["complete"] is True and d["damaged"] == [] and d["not_exported"] == 0 and d["removed"] == 0
    assert d["rows"] == 4 and d["added"] == 4 and d["bytes"] == report.bytes_written > 0
    assert d["options"]["limit"] == 4 and d["options"]["draft_vocab_size"] == D
    assert d["final_state"] == "post_norm" and d["layer_ids"] == report.layer_ids


# -- 8. the target volume's watermarks -----------------------------------------------------------------------------

def _fill_to(mnt: Path, fraction: float) -> Path:
    st = os.statvfs(mnt)
    total, used = st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bavail) * st.f_frsize
    filler = mnt / "filler.bin"
    with open(filler, "wb") as f:
        f.write(b"\xff" * max(0, int(total * fraction) - used))
    return filler


def test_export_respects_the_target_watermarks(post, tmpfs):
    """On a 24 MB tmpfs (--low 0.5 --high 0.6): a 1.3 MB export onto a volume at 57% is refused (exit 3) before any
    sample file; with --allow-overcommit at 65% it pauses (alive, no file), and finishes once space returns."""
    out = tmpfs / "out"
    wm = ("--low", "0.5", "--high", "0.6", "--flood", "0.95")
    filler = _fill_to(tmpfs, 0.57)
    cp = hsbuild("export", post, out, "--format", "specforge", "--no-progress", *wm)
    assert cp.returncode == 3, f"exit {cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-overcommit" in lines[0] and "Traceback" not in cp.stderr, cp.stderr
    assert not out.exists() or sorted(os.listdir(out)) == [JOURNAL]  # no sample file, no temp file

    filler.unlink()
    filler = _fill_to(tmpfs, 0.65)
    out = tmpfs / "out2"
    proc = forked.Popen([sys.executable, "-m", "builder.cli", "export", str(post), str(out), "--format",
                             "specforge", "--no-progress", "--json", "--allow-overcommit", *wm],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / JOURNAL).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the journal is written just before the export looks at the volume
        assert (out / JOURNAL).exists(), f"the export never got going: {proc.poll()}"
        time.sleep(2.5)  # past its first checks of the volume: it polls every second while paused
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.communicate()}"
        assert not _ckpts(out) and not list(out.rglob("*" + TMP_SUFFIX)), "wrote onto a volume above `high`"
        filler.unlink()  # space returns: it resumes by itself
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stderr}"
    report = json.loads(stdout)
    assert report["pauses"] >= 1 and report["complete"] and report["exported"] == 40
    assert len(_ckpts(out)) == 40


def test_refused_export_can_follow_its_own_advice_in_the_same_out(post, tmpfs):
    """The exit-3 refusal says "export a part (--subset/--limit)"; doing so into the same OUT must work: a refused
    export has exported nothing, so it must not leave a journal that pins OUT to the refused options."""
    out = tmpfs / "out"
    wm = Watermarks(low=0.5, high=0.6, flood=0.95)
    _fill_to(tmpfs, 0.57)
    with pytest.raises(WontFitError, match="--limit"):
        export_build(post, out, ExportOptions(format="specforge", watermarks=wm))
    report = export_build(post, out, ExportOptions(format="specforge", limit=3, watermarks=wm))
    assert report.complete and report.exported == 3


# -- 9. durable once it says complete -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_finished_export_survives_a_power_cut(fmt, post, pre, powercut):
    """Under POSIX's worst case (lazyfs --dirs strict: a rename is durable once ITS directory is fsynced), an export
    that finished (journal `complete`, exit 0) still has every file after a power cut, sample files in rows_*/ or
    hidden_states/ included."""
    build = post if fmt == "specforge" else pre
    fs = powercut("strict")
    r = fs.run(["export", build, "OUT", "--format", fmt, "--limit", "6", "--no-progress", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["complete"]
    report = fs.crash()
    fs.remount()
    out = fs.path("OUT")
    assert json.loads((out / JOURNAL).read_text())["complete"] is True
    want = [f"rows_0-2000/data_{i}.ckpt" for i in range(6)] if fmt == "specforge" else \
        [f"hidden_states/hs_{i}.safetensors" for i in range(6)]
    have = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    missing = sorted(set(want) - set(have))
    assert not missing, f"the journal says complete, but {missing} vanished (lazyfs: {report.get('vanished')})"
