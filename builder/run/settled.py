"""A build with nothing to do, known without reading its source: `hsbuild resume` on a complete build.

A run records in its `run_started` event the identity of the source file it read (`source_stat`: its absolute
path, device, inode, size, mtime_ns and ctime_ns, taken before reading it) beside the config's fingerprint. By
then the run has compared that source with the registry and recorded (or refused) every difference, so the
registry then held exactly the file's samples. `settled` answers whether a resume would find nothing to do from
the lock file, one `stat` of the source and one read-only open of the log with two small queries, never the
source's rows nor a replay into a plan: a resume then records nothing and starts no worker.

It answers only when it can be sure, else None and the resume takes the long way (which may well find nothing
to do either, and says so as before):
- the build can be written (a read-only one is refused by the long way, nothing to do or not);
- no owner holds the build, and the last one released it cleanly (a dead owner's record is the long way's to
  name, in its `run_started`);
- the log's views are this version's (an older log is upgraded by the long way, as an owner opens it);
- the last `run_started` recorded a source identity, after any `log_rebuilt` (a rebuilt log is resumed the long
  way: it checks what the data holds), with this config's fingerprint (a changed format key is the long way's to
  refuse), and the source file is exactly that file still: same path, device, inode, size, mtime and ctime. Any
  write to a file changes its ctime, which no user can set back (the rule the model's weights cache follows,
  docs/design.md section 2); a file replaced by another is another inode, or a later ctime;
- every registered sample is `written`, `verified` or `retired` (one query over the fold: a sample failed,
  damaged, in flight, pending, sent back by a transient failure, or unskipped is work, and the long way does it).

A file changed within the clock's granularity of the `stat` could keep its ctime (timestamps tick in
milliseconds on some filesystems): a run records no identity for a source modified less than RACY_SECONDS
before it looked (as git treats a racily clean index entry), so the next resume reads it whole. A source read
through a Hugging Face tokenizer (`text` or conversation rows of a build with a model directory) gets no identity
either: its samples depend on the tokenizer's files too.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from builder.config import BuildConfig
from builder.errors import HsbuildError
from builder.layout import BuildLayout
from builder.log.events import EventLog
from builder.log.lock import inspect_lock
from builder.log.schema import schema_digest

if TYPE_CHECKING:
    from builder.run.preparation import Prepared

RACY_SECONDS = 2.0  # a source modified less than this before it was looked at gets no identity (see above)
STAT_KEYS = ("path", "dev", "ino", "size", "mtime_ns", "ctime_ns")


def source_stat(path: Path, now_ns: int | None = None) -> dict | None:
    """The source file's identity (what `run_started` records as `source_stat`), or None where it cannot vouch
    for the content: not a regular file, or modified less than RACY_SECONDS before `now_ns` (default: now)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    now_ns = time.time_ns() if now_ns is None else now_ns
    if not stat.S_ISREG(st.st_mode) or now_ns - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_SECONDS * 1e9:
        return None
    return {"path": str(Path(path).absolute()), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


@dataclass(frozen=True)
class Settled:
    """A complete build: what `resume` says instead of running."""

    events: int  # the log's last seq
    done: int  # written or verified
    retired: int
    run_id: str  # the run that recorded the source's identity

    def line(self) -> str:
        return (f"replayed {self.events} events: {self.done} done, {self.retired} retired, nothing else; 0 to do "
                f"now (the source is the file run {self.run_id[:8]} read; nothing recorded, no worker started)")


# the last run's record, and the last rebuild of the log (a rebuilt log's `init` says so too)
LAST_RUN_SQL = """
SELECT seq, run_id, json_extract(detail, '$.source_stat') AS stat,
       json_extract_string(detail, '$.config_fingerprint') AS config,
       (SELECT coalesce(max(seq), 0) FROM events WHERE kind = 'log_rebuilt'
            OR (kind = 'init' AND json_extract(detail, '$.rebuilt') IS NOT NULL)) AS rebuilt
FROM events WHERE kind = 'run_started' ORDER BY seq DESC LIMIT 1
"""
# registered samples, and of them those whose state is written/verified (mkind written) or retired: the `samples`
# view's state rule, over `sample_fold` semi-joined with the registry (as the plan reads it, run/plan.py)
COUNTS_SQL = """
SELECT (SELECT count(*) FROM source_samples),
       count(*) FILTER (WHERE f.mkind = 'written'), count(*) FILTER (WHERE f.mkind = 'retired')
FROM sample_fold f WHERE f.sample_id IN (SELECT sample_id FROM source_samples)
"""


def settled(lay: BuildLayout, cfg: BuildConfig) -> Settled | None:
    """The build has nothing to do, and its source is the one its last run read (see the module's docstring):
    what to say. None: the long way decides (also on any error here: it reports errors itself)."""
    if not _writable(lay):
        return None  # a build that cannot be written: the long way refuses it, as it refuses any resume of it
    try:
        lock = inspect_lock(lay)
    except OSError:
        return None
    if lock.held or lock.info or not lay.events.exists():
        return None
    now = source_stat(Path(cfg.source))
    if now is None:
        return None
    try:
        log = EventLog(lay.events, read_only=True)
    except (HsbuildError, duckdb.Error, OSError):
        return None
    try:
        digest = log.con.execute("SELECT value FROM meta WHERE key = 'schema_digest'").fetchall()
        if not digest or json.loads(digest[0][0]) != schema_digest():
            return None
        row = log.con.execute(LAST_RUN_SQL).fetchone()
        if row is None:
            return None
        seq, run_id, recorded, config, rebuilt = row
        if recorded is None or seq <= rebuilt or config != cfg.fingerprint():
            return None
        recorded = json.loads(recorded)
        if not isinstance(recorded, dict) or any(recorded.get(k) != now[k] for k in STAT_KEYS):
            return None
        registered, done, retired = log.con.execute(COUNTS_SQL).fetchone()
        if done + retired != registered:
            return None
        return Settled(events=log.last_seq, done=done, retired=retired, run_id=run_id)
    except (duckdb.Error, ValueError):
        return None
    finally:
        log.close()


def _writable(lay: BuildLayout) -> bool:
    """Could a run own the build: its lock file opens for writing (not on a read-only volume) and its directory
    takes new files (as `BuildLock.acquire` asks; nothing is written here)."""
    try:
        fd = os.open(lay.lock, os.O_RDWR)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    else:
        os.close(fd)
    return os.access(lay.root, os.W_OK | os.X_OK)


def resume_settled(prep: Prepared) -> Settled | None:
    """`settled` for a prepared resume; None (the long way) for a moved source (--source: recorded by a run), an
    import, or --ray."""
    if prep.opts.source is not None or prep.importing or prep.opts.ray:
        return None
    return settled(prep.lay, prep.cfg)
