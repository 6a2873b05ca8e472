"""The reader's index made from a snapshot of the `samples` view, and kept in a cache shared by every reader of
the machine.

The snapshot: the log read by columns (Arrow), with no owner from the file in one read-only open, with a live
owner (a run) from one snapshot of its replica, the tables sent over its socket (builder/log/bulk.py). Either
way it comes with the log's state it was taken at (`KEY_SQL`): the number of events, the last one's seq, time, kind and run, the source's samples and the
log's first event. Events are append-only with a strictly increasing seq, so one state of the log has one key,
and a log rolled back and grown again has another (its last event is another's).

The cache: `$HSBUILD_CACHE_DIR/reader-index/` (default `~/.cache/hsbuild`; builder/extract/weights.py), never
the build (a reader writes nothing there: docs/design.md section 6). A file is named by the digest of the
build's path, its log file's identity, the key, the states read and the schema; made once (processes that ask
at once wait on a lock and map the first one's file), written to a temp name and renamed, and checked (version,
key, CRC-32C of its contents) each time it is mapped. A cache folder that cannot be used (not writable, another
user's) leaves the index in memory: the dataset then pickles its arrays.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from builder.layout import BuildLayout
from builder.log.query import read_columns, run_query
from builder.log.schema import schema_digest
from builder.reader.columns import from_arrow
from builder.reader.index import SLOTS, TEMPLATE, VERSION, IndexFileError, ReaderIndex

SNAPSHOT_TIMEOUT_S = 600.0  # the log's read for the index (a live owner's answer for ten million samples)
STALE_AFTER_S = 86400.0  # an index file of the same build unused this long is removed when another is written

KEY_SQL = """
SELECT (SELECT count(*) FROM events) AS events, e.seq AS last_seq, e.ts::VARCHAR AS last_ts, e.kind AS last_kind,
       e.run_id AS last_run, (SELECT count(*) FROM source_samples) AS sources,
       (SELECT run_id || ' ' || ts::VARCHAR FROM events ORDER BY seq LIMIT 1) AS first_event
FROM (SELECT 1) d LEFT JOIN (SELECT seq, ts, kind, run_id FROM events ORDER BY seq DESC LIMIT 1) e ON true
"""
KEY_COLUMNS = ("events", "last_seq", "last_ts", "last_kind", "last_run", "sources", "first_event")
ORDER = "row_idx, sample_id"


def _like_template() -> str:
    """TEMPLATE as a LIKE pattern (escape `\\`): one `_` for each of its digits."""
    digits = {i for s in SLOTS for i in range(s, s + 8)}
    text = TEMPLATE.decode()
    return "".join("_" if i in digits else ("\\" + c if c in "_%\\" else c) for i, c in enumerate(text))


def states_sql(include_unverified: bool) -> str:
    return "('written', 'verified')" if include_unverified else "('verified')"


def base_sql(states: str) -> str:
    """The live samples with their checksums as `digits` (hsbuild's own text: its 32 digits) or `raw` (any other
    text), builder/reader/columns.py."""
    like = _like_template().replace("'", "''")
    digits = " || ".join(f"substr(checksums, {s + 1}, 8)" for s in SLOTS)
    return f"""
SELECT sample_id, row_idx, segment, token_start, num_tokens, CASE WHEN m THEN {digits} END AS digits,
       CASE WHEN NOT m THEN checksums END AS raw
FROM (SELECT *, coalesce(strlen(checksums) = {len(TEMPLATE)} AND checksums LIKE '{like}' ESCAPE '\\', false) AS m
      FROM samples WHERE state IN {states})"""


def rows_sql(states: str) -> str:
    return f"{base_sql(states)}\nORDER BY {ORDER}"


def snapshot(lay: BuildLayout, include_unverified: bool) -> ReaderIndex:
    """The index of the build's live samples now, with the key of the log's state it was read from."""
    states = states_sql(include_unverified)
    _, got = read_columns(lay, [KEY_SQL, rows_sql(states)], timeout=SNAPSHOT_TIMEOUT_S)
    index = from_arrow(got[1], got[0].to_pylist()[0])
    del got
    give_back_memory()
    return index


def give_back_memory() -> None:
    """Return what the snapshot's temporaries (Arrow buffers, numpy arrays) left free in the allocators to the
    system: a training process keeps what it holds, not the peak of making its index (on 945k samples, 155 B a
    sample of anonymous memory left after it otherwise; 49 B with this)."""
    import ctypes  # noqa: PLC0415

    import pyarrow as pa  # noqa: PLC0415

    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # (glibc only)
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def log_key(lay: BuildLayout) -> dict:
    """The key of the log's state now (cheap: no fold)."""
    cols, rows = run_query(lay, KEY_SQL)
    return dict(zip(cols, rows[0], strict=True))


# ---------------------------------------------------------------------------------------------------------------
# the cache


def cache_folder() -> Path | None:
    """The folder of index files, made private to this user; None when it cannot be."""
    from builder.extract.weights import cache_dir  # noqa: PLC0415

    d = cache_dir() / "reader-index"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.access(d, os.W_OK | os.X_OK):
            return None
    except OSError:
        return None
    return d


def file_name(lay: BuildLayout, key: dict, include_unverified: bool) -> str:
    root = str(lay.root.resolve())
    st = lay.events.stat()
    ident = json.dumps([root, st.st_dev, st.st_ino, key, include_unverified, VERSION, schema_digest()],
                       sort_keys=True, default=str)
    build = hashlib.blake2b(root.encode(), digest_size=6).hexdigest()
    return f"{build}-{hashlib.blake2b(ident.encode(), digest_size=12).hexdigest()}.hsidx"


def _mine(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _open_cached(path: Path, key: dict) -> ReaderIndex | None:
    try:
        if not _mine(path):
            return None
        return ReaderIndex.open(path, key)
    except (OSError, IndexFileError):
        return None


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _clean(folder: Path, prefix: str, keep: str) -> None:
    """Remove the build's other index files (and temp files) unused for STALE_AFTER_S."""
    now = time.time()
    for p in folder.glob(f"*{prefix}-*"):
        if p.name == keep or p.suffix == ".lock":
            continue
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > STALE_AFTER_S:
                p.unlink()


def load_index(lay: BuildLayout, include_unverified: bool) -> ReaderIndex:
    """The build's index now: mapped from the cache when one was made for this state of the log, else made
    from a snapshot (and written to the cache, where it can be)."""
    folder = cache_folder()
    if folder is None:
        return snapshot(lay, include_unverified)
    key = log_key(lay)
    name = file_name(lay, key, include_unverified)
    path = folder / name
    found = _open_cached(path, key)
    if found is not None:
        return found
    prefix = name.split("-")[0]
    with _locked(folder / f"{prefix}.lock"):  # one maker per build at a time: the others map its file
        found = _open_cached(path, key)
        if found is not None:
            return found
        index = snapshot(lay, include_unverified)
        made = folder / file_name(lay, index.key, include_unverified)  # (the log may have moved on since)
        try:
            index.write(made)
        except OSError:
            return index
        _clean(folder, prefix, made.name)
        mapped = _open_cached(made, index.key)
        if mapped is None:
            return index
        del index  # (its arrays: the file's mapping serves from now on)
        give_back_memory()
        return mapped
