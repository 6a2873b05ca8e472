"""Failure handling: the workers' reports turned into events.

`Reports` reads what each worker sent (builder/run/messages.py) and commits the events it calls for; it tells the
dispatch what became of each sample (builder/run/dispatch.py), the space monitor what was written or refused for
room, and the engine's supervisor what the engine failed to serve (builder/run/supervision.py). A worker that
died, was lost with its node, or did not stop in time is judged here too. It owns what the run reports of its
samples (`Tally`) and whether a worker's death stops the run (`aborted`).

A response dropped with --drop-truncated is written nowhere in the data, so its retirement is kept beside the
data first: the drops are gathered (`Drops`), written as one `drop` history record (builder/store/history.py,
fsynced) at most every DROP_SECONDS, and only then are their `retired` events emitted, each naming the record.
A crash before the record loses the drops (those samples are `started` in the log: the next run generates them
again); a crash after it, before the events commit, leaves a record the next run catches up on
(builder/run/catchup.py) and rebuild-log replays (builder/run/history_replay.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import DiskFullError, ModelError
from builder.humanize import human_bytes, pct
from builder.log.events import Event, detail
from builder.run import testhook
from builder.run.messages import (
    Abandoned,
    Deferred,
    Dropped,
    Exit,
    Failed,
    Fatal,
    FromWorker,
    NoSpace,
    Ready,
    Sealed,
    SealFailed,
    ServerChecked,
    Skipped,
    Staged,
    Started,
    Unreachable,
    Written,
)
from builder.store.history import history_dir, write_record

if TYPE_CHECKING:
    from builder.config import Watermarks
    from builder.log.session import OwnerSession
    from builder.progress import Progress
    from builder.run.dispatch import Dispatcher
    from builder.run.spawning import Workers
    from builder.run.supervision import Supervisor
    from builder.space.watermarks import SpaceMonitor


@dataclass
class Tally:
    """What the run's workers reported of its samples."""

    written: int = 0
    failed: int = 0
    check_errors: int = 0  # --verify-after-write could not read these back: written, not checked (`check_error`)
    at_token_limit: int = 0  # regenerated responses that stopped at the token limit (finish_reason length), kept
    dropped: int = 0  # ... retired instead (--drop-truncated)


# a regenerated response that stopped at the token limit, retired (--drop-truncated): the `retired` reason, note
AT_TOKEN_LIMIT = "at_token_limit"
DROP_NOTE = "its response stopped at the token limit (--drop-truncated)"
# drops gathered at most this long (or this many) before their record is written and their events emitted: a
# record at most every 5 s, so a long build's data/history/ stays small (each run start lists it)
DROP_SECONDS = 5.0
DROP_BATCH = 10000


def drop_event(sample_id: str, fingerprint: str, attempt: int | None, generation: dict, record: str,
               worker: int | None = None, run_id: str | None = None, **more: object) -> Event:
    """The `retired` event of a dropped response (its detail: the note, the history record that holds the drop,
    `more`, and the generation's figures)."""
    return Event("retired", run_id=run_id, sample_id=sample_id, fingerprint=fingerprint, attempt=attempt,
                 worker=worker, reason=AT_TOKEN_LIMIT,
                 detail=detail(note=DROP_NOTE, record=record, **more, **generation))


class Drops:
    """Dropped responses not yet recorded: written as one `drop` history record, then emitted as `retired`."""

    def __init__(self, data: Path, run_id: str, run_ordinal: int, session: OwnerSession,
                 echo: Callable[[str], None], on_full: Callable[[], None]):
        self._data, self._run_id, self._after, self._echo = data, run_id, run_ordinal, echo
        self._session, self._on_full = session, on_full
        self._held: list[Dropped] = []
        self._since = 0.0
        self._said = False

    def add(self, msg: Dropped) -> None:
        if not self._held:
            self._since = time.monotonic()
        self._held.append(msg)

    def commit(self, force: bool = False) -> int:
        """The record, then the events, when due (or now, with `force`); returns how many were recorded. A record
        that cannot be written (an I/O error; a full volume, which pauses the run and gives up the ballast, as a
        sample's write does) keeps the drops held, tried again DROP_SECONDS later; at the run's end (`force`)
        they are said not recorded: the log leaves those samples `started`, and the next run generates them
        again."""
        held = self._held
        if not held or not (force or len(held) >= DROP_BATCH or time.monotonic() - self._since >= DROP_SECONDS):
            return 0
        try:
            with self._session.watch.track("drop history record", history_dir(self._data)):  # (a stalled volume)
                rec = write_record(self._data, "drop", self._run_id, {"samples": [
                    {"sample_id": m.sample_id, "fingerprint": m.fingerprint, "attempt": m.attempt,
                     "generation": m.generation} for m in held]}, after=self._after)
        except (DiskFullError, OSError) as e:
            if isinstance(e, DiskFullError):
                self._on_full()
            if force or not self._said:
                self._echo(f"\n{len(held)} dropped response(s) (--drop-truncated) not recorded yet: {e}"
                           + ("; they are left for the next run, which generates them again" if force else
                              f"; tried again in {DROP_SECONDS:g} s"))
                self._said = True
            self._since = time.monotonic()
            return 0
        testhook.after_record("drop")  # (the suite's SIGKILL between the record and the events)
        self._held = []
        for m in held:
            self._session.emit(drop_event(m.sample_id, m.fingerprint, m.attempt, m.generation, rec.name,
                                          worker=m.worker))
        return len(held)


@dataclass(frozen=True)
class Imported:
    """An import's samples: the dump file each is taken from (recorded with its events), and the dump's format."""

    files: dict[str, str]
    format: str


class Reports:
    """The workers' reports (see the module's docstring). `fingerprint`: the model's, as the build recorded it
    (a worker whose model differs stops the run); `bar`: the progress the caller watches."""

    def __init__(self, session: OwnerSession, workers: Workers, dispatch: Dispatcher, space: SpaceMonitor,
                 engine: Supervisor, bar: Progress, echo: Callable[[str], None], *, fingerprint: str | None,
                 watermarks: Watermarks, data: Path, imported: Imported | None = None, run_id: str = "",
                 run_ordinal: int = 0):
        self._session, self._workers, self._dispatch = session, workers, dispatch
        self._space, self._engine = space, engine
        self._bar, self._echo = bar, echo
        self._fingerprint, self._wm, self._data = fingerprint, watermarks, data
        self._imported = imported
        self.tally = Tally()
        self._drops = Drops(data, run_id, run_ordinal, session, echo, space.disk_full)
        self._aborted: str | None = None
        self._landed = False

    @property
    def aborted(self) -> str | None:
        """Why a worker's death stops the run at a safe point (`resume` continues), or None."""
        return self._aborted

    def landed(self) -> bool:
        """A sample was written since the last call (the disk figures are then polled afresh)."""
        landed, self._landed = self._landed, False
        return landed

    def _emit(self, ev: Event) -> None:
        self._session.emit(ev)

    def commit_drops(self, force: bool = False) -> None:
        """The dropped responses gathered, recorded beside the data and retired, when due (`Drops.commit`)."""
        self.tally.dropped += self._drops.commit(force)

    # -- one worker's messages ---------------------------------------------------------------------------------
    def drain(self, w: int) -> None:
        """Handle every message worker `w` has sent so far, in order. At EOF (its end of the pipe is closed: the
        process is gone) a worker that never said `exit` died."""
        conn = self._workers.conn(w)
        while self._dispatch.is_alive(w):
            try:
                if not conn.poll(0):
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                self.worker_died(w)
                return
            self.handle(msg)

    def handle(self, msg: FromWorker) -> None:
        wid, st = msg.worker, self._dispatch
        match msg:
            case Ready(fingerprint=fp):
                st.ready(wid, msg.capacity)
                if msg.device.startswith("cuda"):
                    self._echo(f"worker {wid}: on {msg.device}")
                if self._fingerprint and fp != self._fingerprint:
                    self._session.request_stop()
                    raise ModelError(
                        f"model fingerprint {fp} differs from the build's {self._fingerprint}: the model "
                        "changed since `init`; restore it, or start a new build with `hsbuild init --force`"
                    )
            case Fatal(error=error):
                raise ModelError(f"worker {wid} could not start: {error}")
            case Started(sample_id=sid, attempt=attempt, fingerprint=fp):
                st.started(wid, sid, attempt)
                self._emit(Event("started", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                 detail=detail(origin="import") if self._origin(sid) else None))
            case Staged(sample_id=sid):
                st.stage(wid, sid)
            case Unreachable(sample_id=sid, attempt=attempt, fingerprint=fp, message=message, refused=refused,
                             need_bytes=need, too_small=too_small):
                # the engine's failure, not the sample's: back to pending, not counted against --max-attempts
                self._emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                 reason="server_unavailable", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)
                if refused:
                    self._engine.refused(message)
                elif too_small:
                    self._engine.staging_too_small(message)
                else:
                    self._engine.unavailable(message, need)
            case ServerChecked(found=found):
                self._engine.rechecked(wid, found)
            case Written():
                self._written(msg)
            case Dropped(sample_id=sid):
                self._drops.add(msg)  # recorded beside the data, then retired (`commit_drops`)
                st.done(wid, sid)
                self._bar.update(1)
            case Failed(sample_id=sid, attempt=attempt, fingerprint=fp, reason=reason, message=message):
                self._emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, reason=reason,
                                 detail=detail(message=message)))
                st.done(wid, sid)
                self.tally.failed += 1
                self._bar.update(1)
            case NoSpace(sample_id=sid, attempt=attempt, fingerprint=fp, message=message):
                self._emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                 reason="no_space", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)  # retried once space returns
                self._space.disk_full()
            case Deferred():
                self._deferred(msg)
            case Skipped(sample_id=sid) | Abandoned(sample_id=sid):
                st.done(wid, sid, requeue=not self._session.stop_requested)
            case Sealed(info=info):
                self._emit(Event("segment_sealed", worker=wid, segment=info["segment"], num_tokens=info["tokens"],
                                 detail=detail(**info)))
            case SealFailed(segment=segment, error=error):
                self._emit(Event("segment_sealed", worker=wid, segment=segment, reason="seal_failed",
                                 detail=detail(error=error)))
            case Exit():
                st.exited(wid)

    def _written(self, msg: Written) -> None:
        wid, sid, attempt, fp, loc = msg.worker, msg.sample_id, msg.attempt, msg.fingerprint, msg.location
        self._landed = True
        self._emit(Event("written", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                         segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                         nbytes=loc.nbytes, checksums=json.dumps(loc.checksums, sort_keys=True),
                         detail=detail(truncated=msg.truncated, seconds=round(msg.seconds, 4),
                                       disk_bytes=loc.disk_bytes, **self._provenance(sid), **_quant_error(loc),
                                       **(msg.generation or {}))))
        if msg.generation and msg.generation.get("finish_reason") == "length":
            self.tally.at_token_limit += 1
        if msg.verified:
            self._emit(Event("verified", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                             segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                             detail=detail(mode="after_write")))
        elif msg.check_error is not None:  # could not be read back: written, not checked (no state change)
            self._emit(Event("check_error", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                             segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                             reason="check_error", detail=detail(mode="after_write", message=msg.check_error)))
            self.tally.check_errors += 1
        self._dispatch.done(wid, sid)
        self.tally.written += 1
        self._space.account(loc.nbytes, loc.num_tokens)
        self._bar.update(1, loc.num_tokens, loc.nbytes)

    def _deferred(self, msg: Deferred) -> None:
        """A write that would cross `flood`: it waits until it fits, unless the volume can never hold it."""
        wid, sid, projected = msg.worker, msg.sample_id, msg.projected
        room = self._space.never_fits(projected, msg.total, msg.free)
        if room is None:  # waits until it fits
            self._dispatch.done(wid, sid, requeue=True)
            self._space.flood_block(projected)
            return
        wm = self._wm
        message = (f"needs {projected} bytes ({human_bytes(projected)}, uncompressed upper bound) but the "
                   f"volume of {self._data} ({human_bytes(msg.total)}) has room for only {room} bytes "
                   f"({human_bytes(room)}) below the flood watermark ({pct(wm.flood)})"
                   + (f" and min_free ({human_bytes(wm.min_free)})" if wm.min_free else "")
                   + " besides the other files on it, even without this build's data; it can never be "
                   "written there: grow or clean the volume, raise --flood, or lower --max-tokens")
        self._emit(Event("failed", sample_id=sid, fingerprint=msg.fingerprint, attempt=msg.attempt,
                         worker=wid, reason="too_big_for_volume",
                         detail=detail(message=message, projected=projected, room=room)))
        self._echo(f"\nsample {sid} failed: too big for the volume: {message}")
        self._dispatch.done(wid, sid)
        self.tally.failed += 1
        self._bar.update(1)

    def _origin(self, sid: str) -> str | None:
        return self._imported.files.get(sid) if self._imported is not None else None

    def _provenance(self, sid: str) -> dict:
        origin = self._origin(sid)
        return {} if origin is None else {"import": {"file": origin, "format": self._imported.format}}

    # -- workers gone --------------------------------------------------------------------------------------------
    def worker_died(self, w: int) -> None:
        """Worker `w` is gone without saying `exit`. Its sample in hand failed (`worker_died`); samples only queued
        to it go back to pending; the run stops. A Ray worker that was lost (its node or actor gone, not its
        sample's fault): everything it held goes back to pending (`worker_lost`, retried without limit) and the
        run goes on with the others."""
        code, lost = self._workers.exit_code(w), self._workers.lost(w)
        if lost is not None:
            self._worker_lost(w, lost)
            return
        st = self._dispatch
        in_hand = st.in_hand(w)
        self._echo(f"\nworker {w} died (exit code {code})" + (f" while on sample {in_hand}" if in_hand else ""))
        held = in_hand is not None and st.handed(w, in_hand)
        st.take_back(w, keep=in_hand)
        if held:
            self._emit(Event("failed", sample_id=in_hand, attempt=st.attempt(in_hand), worker=w,
                             reason="worker_died", detail=detail(exitcode=code)))
            self.tally.failed += 1
        self._aborted = f"worker {w} died (exit code {code})"
        self._echo("stopping the run at a safe point; `hsbuild resume` continues")

    def _worker_lost(self, w: int, why: str) -> None:
        st = self._dispatch
        in_hand = st.in_hand(w)
        back = st.take_back(w)  # its sample in hand too: not the sample's fault, retried without limit
        if in_hand is not None:
            self._emit(Event("failed", sample_id=in_hand, attempt=st.attempt(in_hand), worker=w,
                             reason="worker_lost", detail=detail(message=why)))
        self._emit(Event("worker_lost", worker=w, detail=detail(message=why, requeued=len(back))))
        left = st.going_on()  # (a worker told to stop takes no more samples)
        self._echo(f"\nworker {w} lost ({why}); its {len(back)} sample(s) go back to pending; {left} worker(s) go on")
        if not left and st.pending():
            self._aborted = ("every Ray worker is gone" if not st.alive() else
                             "no Ray worker is left to take the lost worker's samples")
            self._echo("stopping the run at a safe point; `hsbuild resume` continues")

    def give_up_on(self, grace: float) -> None:
        """Workers that did not stop within the grace period (hung, or frozen by SIGSTOP) are killed and named.
        The sample in hand stays `started` for `resume` (not charged a failure); queued ones go back to pending."""
        st = self._dispatch
        for w in st.alive():
            in_hand = st.in_hand(w)
            self._echo(f"\nworker {w} (pid {self._workers.pid(w)}) did not stop within {grace:g} s; killing it "
                       "(still safe)" + (f"; its sample {in_hand} is left for `hsbuild resume`, not counted as failed"
                                         if in_hand else "; it held no sample"))
            self._workers.kill(w)
            st.take_back(w, keep=in_hand)


def _quant_error(loc) -> dict:  # noqa: ANN001 - a store.segment.Location
    """The written event's `fp8_error` (an fp8 build: each state field's relative RMS error), else nothing."""
    if not loc.quant_error:
        return {}
    return {"fp8_error": {k: round(v, 6) for k, v in loc.quant_error.items()}}
