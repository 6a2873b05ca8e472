"""A sweep checks samples that share shard files a group at a time (builder/verify/batch.py): it must find exactly
what checking each sample alone finds (`store.readback.check_sample` / `check_files`, through Zarr), whatever the
damage in a shared file, and keep a check that cannot run apart from damage, sample by sample."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from conftest import ROOMY, random_rows, write_jsonl
from verify_helpers import TINY, copy_build, events, flip_bit, live, sample_chunks, sweep

from builder.config import load_config
from builder.layout import layout
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store import reader as store_reader
from builder.store.readback import RETRIES, check_files, check_sample, field_specs
from builder.store.segment import field_geometry
from builder.store.shard import EMPTY, encode_shard, read_index

N = 60


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """60 samples written by one worker in one group, 16-token chunks: three shard files a field, each shared by
    about 20 samples (some samples run from one shard into the next)."""
    root = tmp_path_factory.mktemp("units")
    src = write_jsonl(root / "source.jsonl", random_rows(N, seed=5, lo=5, hi=60))
    lay = init_build(root / "template", src, watermarks=ROOMY, model=TINY, chunk_tokens=16)
    run_build(lay.root, RunOptions(), echo=lambda m: None)
    return lay.root


@pytest.fixture
def build(template, tmp_path) -> Path:
    return copy_build(template, tmp_path / "b")


def shards_of(build: Path, fld: str) -> dict[Path, list[str]]:
    """Each shard file of `fld` -> the samples with chunks in it."""
    out: dict[Path, list[str]] = {}
    for sid, r in sorted(live(build).items(), key=lambda kv: kv[1]["token_start"]):
        for p in sample_chunks(build, r, fld):
            out.setdefault(p, []).append(sid)
    return out


def alone(build: Path, quick: bool) -> dict[str, tuple[str, str] | None]:
    """What checking each sample a sweep selects (written or verified) on its own finds (reason, message), None
    when good."""
    data = layout(build).data
    out = {}
    for sid, r in live(build).items():
        if r["state"] not in ("written", "verified"):
            continue
        seg = data / r["segment"]
        specs = field_specs(seg)
        ct = specs["input_ids"].chunk_tokens if specs else 16
        if quick:
            res = check_files(data, r["segment"], r["token_start"], r["num_tokens"], ct, r["nbytes"], quick=True,
                              specs=specs)
        else:
            res = check_sample(data, r["segment"], r["token_start"], r["num_tokens"], r["checksums"], ct)
        out[sid] = res.finding
    return out


def found(s, selected) -> dict[str, tuple[str, str] | None]:
    got: dict[str, tuple[str, str] | None] = dict.fromkeys(selected)
    got.update({d.sample_id: (d.reason, d.message) for d in s.damaged})
    return got


def test_damage_in_shared_shards_is_found_as_checking_each_sample_alone_finds_it(build):
    by_name = lambda d: sorted(d, key=lambda p: int(p.name.split(".")[1]))  # noqa: E731
    hs, aux, lm = (shards_of(build, f) for f in ("hidden_state", "aux_hidden_state", "loss_mask"))
    assert len(hs) < N and max(len(v) for v in hs.values()) > 1  # samples do share files here
    first = by_name(hs)[0]
    victim = live(build)[hs[first][0]]
    flip_bit(first, min(victim["num_tokens"], load_config(layout(build)).chunk_tokens) * 64 * 2)  # silent
    holed = live(build)[hs[first][2]]  # a chunk of another sample of that shard dropped from it (a valid index)
    drop_chunk(first, holed["token_start"] // 16)
    gone = by_name(aux)[-1]
    gone.unlink()  # every sample with aux rows in the last shard: missing
    assert len(lm) >= 3
    cut = by_name(lm)[1]
    os.truncate(cut, cut.stat().st_size - 3)  # an index cut short: unreadable
    for quick in (True, False):
        expected = alone(build, quick)
        assert any(v is None for v in expected.values()) and any(v is not None for v in expected.values())
        s = sweep(build, quick=quick)  # (quick records what it finds: the full sweep then checks the rest)
        assert found(s, expected) == expected, quick
        assert s.checked == len(expected) and s.ok == sum(v is None for v in expected.values())
    full = found(s, expected)  # the full sweep (the last) found the flipped bit in the shard's first sample
    assert full[hs[first][0]][0] == "checksum_mismatch"
    assert hs[first][2] not in expected  # the quick sweep found the dropped chunk (and the full one left it)
    assert events(build, "WHERE kind = 'failed' AND sample_id = ?", (hs[first][2],))[0]["reason"] == "missing_data"
    neighbours = [sid for sid in hs[first][3:] if sid not in set(aux[gone]) | set(lm[cut])]
    assert neighbours and all(full[sid] is None for sid in neighbours)


def drop_chunk(shard: Path, k: int) -> None:
    """Rewrite a shard file without its inner chunk `k`: its index (valid, CRC and all) marks that chunk absent."""
    _, sc = field_geometry(shard.parent.parent, shard.parent.name)
    idx, whole = read_index(shard, sc), shard.read_bytes()
    shard.write_bytes(encode_shard([None if o == EMPTY or i == k else whole[o : o + n]
                                    for i, (o, n) in enumerate(idx.tolist())]))


def test_a_shared_file_that_cannot_be_read_makes_its_samples_not_checked_never_damaged(build, monkeypatch):
    aux = shards_of(build, "aux_hidden_state")
    victim, members = next((p, m) for p, m in aux.items() if len(m) > 1)
    real_probe = store_reader.probe_file
    calls = {"n": 0}

    def probe(path):  # the seam every data file is opened through
        if str(path) == str(victim):
            calls["n"] += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_probe(path)

    monkeypatch.setattr(store_reader, "probe_file", probe)
    s = sweep(build, jobs=1)
    assert sorted(n.sample_id for n in s.not_checked) == sorted(members)
    assert all(f"({1 + RETRIES} tries)" in n.message and "EMFILE" in n.message for n in s.not_checked)
    assert s.damaged == [] and s.ok == N - len(members) and s.exit_code == 1
    assert calls["n"] <= len(members) * (1 + RETRIES)  # the group's try was each one's first: none tried more
    assert not events(build, "WHERE kind = 'failed'")


def test_a_sweep_commits_from_one_thread(build, monkeypatch):
    """Verdicts are committed in batches by the session's one commit thread, never a thread per flush."""
    names: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        names.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    s = sweep(build, jobs=2)
    assert s.ok == N
    assert names.count("hsbuild-commit") <= 1, names
    assert len(events(build, "WHERE kind = 'verified'")) == N
