"""Shared by test_verify.py and test_gc.py: a real two-segment build made once per module, copied per test, and
fault injectors that damage real chunk files the way disks and crashed writers do."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
from conftest import ROOMY, random_rows, write_jsonl

from builder.config import load_config
from builder.layout import layout
from builder.log.events import EventLog
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build
from builder.store.direct import FieldLayout
from builder.store.segment import field_geometry, sample_files
from builder.store.shard import EMPTY, read_index
from builder.verify.sweep import SweepOptions, SweepSummary, run_sweep

TINY = "builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,intermediate=128"
N_SAMPLES, FIRST_RUN = 24, 8


def make_template(root: Path) -> Path:
    """24 samples: s0000..s0007 in one segment (a run with --limit 8), the other 16 in a second one."""
    src = write_jsonl(root / "source.jsonl", random_rows(N_SAMPLES, seed=3, lo=20, hi=150))
    lay = init_build(root / "template", src, watermarks=ROOMY, model=TINY)
    # one sample a group: each sample has shard files of its own, so a fault planted in one damages only it
    old = os.environ.get("HSBUILD_GROUP_SAMPLES")
    os.environ["HSBUILD_GROUP_SAMPLES"] = "1"
    try:
        run_build(lay.root, RunOptions(limit=FIRST_RUN), echo=lambda m: None)
        run_build(lay.root, RunOptions(), echo=lambda m: None)
    finally:
        if old is None:
            del os.environ["HSBUILD_GROUP_SAMPLES"]
        else:
            os.environ["HSBUILD_GROUP_SAMPLES"] = old
    return lay.root


_TEMPLATE: list[Path] = []


def shared_template(tmp_path_factory) -> Path:
    """One template per test session, shared by test_verify.py and test_gc.py (tests only ever use copies)."""
    if not _TEMPLATE:
        _TEMPLATE.append(make_template(tmp_path_factory.mktemp("verify-template")))
    return _TEMPLATE[0]


def copy_build(template: Path, dst: Path) -> Path:
    shutil.copytree(template, dst, ignore=shutil.ignore_patterns(".ballast", "hsbuild.sock"))
    return dst


def live(build: Path) -> dict[str, dict]:
    """sample_id -> its row of the `samples` view."""
    with EventLog(layout(build).events, read_only=True) as log:
        return {r["sample_id"]: r for r in log.samples()}


def events(build: Path, where: str = "", params: tuple = ()) -> list[dict]:
    with EventLog(layout(build).events, read_only=True) as log:
        return log.query_dicts(f"SELECT * FROM events {where} ORDER BY seq", params)


def sweep(build: Path, **kw) -> SweepSummary:
    return run_sweep(build, SweepOptions(**kw), echo=lambda m: None)


def sample_chunks(build: Path, row: dict, fld: str) -> list[Path]:
    """The files holding a sample's field (its shard files; each run sample is its own group here)."""
    return sample_files(layout(build).data / row["segment"], fld, row["token_start"], row["num_tokens"])


def file_set(build: Path) -> dict[str, str]:
    """Every file of the build's data (not the lock, the socket, the ballast, nor the log and the history records
    that the owner commands write: a sweep adds its verdicts) -> blake2b of its bytes."""
    out = {}
    for d, _, files in os.walk(build):
        for f in files:
            p = Path(d) / f
            rel = str(p.relative_to(build))
            if (rel in ("hsbuild.lock", "hsbuild.sock", ".ballast") or rel.startswith("events.duckdb")
                    or rel.startswith("data/history/")):
                continue
            out[rel] = hashlib.blake2b(p.read_bytes(), digest_size=8).hexdigest()
    return out


# -- faults ------------------------------------------------------------------------------------------------


class _Raw:
    """codec `none`: the chunk's bytes as they are."""

    @staticmethod
    def decode(b: bytes) -> bytes:
        return b


def flip_bit(chunk: Path, valid_bytes: int) -> int:
    """Flip one bit of the first inner chunk of a shard file so that it still decodes (with the field's codec:
    zstd, blosc or none), to different bytes inside the sample's rows (silent corruption: only the checksum can
    tell). The shard's index is untouched. Returns the byte offset flipped."""
    whole = chunk.read_bytes()
    _, shard_chunks = field_geometry(chunk.parent.parent, chunk.parent.name)
    idx = read_index(chunk, shard_chunks)
    off, n = next((int(o), int(k)) for o, k in idx.tolist() if o != EMPTY)
    data = whole[off : off + n]
    codec = FieldLayout.of(chunk.parent.parent, chunk.parent.name).codec or _Raw()
    orig = np.frombuffer(codec.decode(data), dtype=np.uint8)[:valid_bytes]
    mid = len(data) // 2
    for pos in sorted(range(len(data)), key=lambda i: abs(i - mid)):
        b = bytearray(data)
        b[pos] ^= 0x10
        try:
            out = np.frombuffer(codec.decode(bytes(b)), dtype=np.uint8)
        except Exception:  # noqa: BLE001 - this flip breaks the frame; look for one that does not
            continue
        if out.size >= valid_bytes and not np.array_equal(out[:valid_bytes], orig):
            chunk.write_bytes(whole[:off] + bytes(b) + whole[off + n :])
            return off + pos
    raise AssertionError(f"no decodable bit flip found in {chunk}")


def truncate(chunk: Path) -> None:
    size = chunk.stat().st_size
    os.truncate(chunk, size // 2)  # a shard loses its index (at the end): unreadable


def inject_faults(build: Path) -> dict[str, str]:
    """Damage the template copy; returns sample_id -> the reason verify must report.

    - the first run's whole segment deleted          -> its 8 samples: missing_data
    - s0010: one bit flipped inside a hidden_state chunk -> checksum_mismatch
    - s0011: an aux_hidden_state chunk truncated         -> unreadable
    - s0012: an input_ids chunk deleted                  -> missing_data
    - s0013: a loss_mask chunk made zero-length          -> unreadable
    """
    rows = live(build)
    expected: dict[str, str] = {}
    first_seg = rows["s0000"]["segment"]
    assert all(rows[f"s{i:04d}"]["segment"] == first_seg for i in range(FIRST_RUN))
    assert all(rows[f"s{i:04d}"]["segment"] != first_seg for i in range(FIRST_RUN, N_SAMPLES))
    shutil.rmtree(layout(build).data / first_seg)
    expected.update({f"s{i:04d}": "missing_data" for i in range(FIRST_RUN)})

    r = rows["s0010"]
    ct = load_config(layout(build)).chunk_tokens
    flip_bit(sample_chunks(build, r, "hidden_state")[0], min(r["num_tokens"], ct) * 64 * 2)
    expected["s0010"] = "checksum_mismatch"
    truncate(sample_chunks(build, rows["s0011"], "aux_hidden_state")[-1])
    expected["s0011"] = "unreadable"
    sample_chunks(build, rows["s0012"], "input_ids")[0].unlink()
    expected["s0012"] = "missing_data"
    os.truncate(sample_chunks(build, rows["s0013"], "loss_mask")[0], 0)
    expected["s0013"] = "unreadable"
    return expected
