"""Message handling: what the Coordinator (builder/run/coordinator.py) does with each report a worker sends
(builder/run/messages.py): the events it commits, the dispatch bookkeeping it updates, and the pauses, refusals
and stops a report calls for.
"""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from builder.errors import ModelError
from builder.humanize import human_bytes, pct
from builder.log.events import Event, detail
from builder.run.dispatch import PER_WORKER
from builder.run.messages import (
    Abandoned,
    Deferred,
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

if TYPE_CHECKING:
    from builder.run.dispatch import Dispatch


class HandlingMixin:
    """The Coordinator's handling of the workers' reports. (Mixed into Coordinator: uses its events, dispatch
    bookkeeping, space monitor and engine supervision.)"""

    def _handle(self, msg: FromWorker, st: Dispatch, by_id, meta, bar, report) -> None:
        wid = msg.worker
        match msg:
            case Ready(fingerprint=fp):
                st.ready.add(wid)
                if msg.device.startswith("cuda"):
                    self.echo(f"worker {wid}: on {msg.device}")
                st.window[wid] = max(PER_WORKER, msg.capacity + 1)  # all its requests in flight, one waiting
                if meta.get("model_fingerprint") and fp != meta["model_fingerprint"]:
                    self.stop_requested = max(self.stop_requested, 1)
                    raise ModelError(
                        f"model fingerprint {fp} differs from the build's {meta['model_fingerprint']}: the model "
                        "changed since `init`; restore it, or start a new build with `hsbuild init --force`"
                    )
            case Fatal(error=error):
                raise ModelError(f"worker {wid} could not start: {error}")
            case Started(sample_id=sid, attempt=attempt, fingerprint=fp):
                st.current[wid] = sid
                st.in_flight.add(sid)
                st.attempts[sid] = attempt
                self.emit(Event("started", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                detail=detail(origin="import") if sid in self.dump_files else None))
            case Staged(sample_id=sid):
                st.stage(wid, sid)
            case Unreachable(sample_id=sid, attempt=attempt, fingerprint=fp, message=message, refused=refused,
                             need_bytes=need, too_small=too_small):
                # the engine's failure, not the sample's: back to pending, not counted against --max-attempts
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                reason="server_unavailable", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)
                if refused:
                    self._server_refused(message)
                elif too_small:
                    self._staging_too_small(message)
                else:
                    self._engine_unavailable(message, report, need)
            case ServerChecked(found=found):
                self.emit(Event("engine_probe", worker=wid, detail=detail(
                    server=self.engine.server if self.engine is not None else None, recheck=True, **found)))
                self.flush(force=True)
            case Written(sample_id=sid, attempt=attempt, fingerprint=fp, location=loc):
                self._landed = True
                self.emit(Event("written", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                nbytes=loc.nbytes, checksums=json.dumps(loc.checksums, sort_keys=True),
                                detail=detail(truncated=msg.truncated, seconds=round(msg.seconds, 4),
                                              disk_bytes=loc.disk_bytes, **self._provenance(sid),
                                              **_quant_error(loc))))
                if msg.verified:
                    self.emit(Event("verified", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                    segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                    detail=detail(mode="after_write")))
                elif msg.check_error is not None:  # could not be read back: written, not checked (no state change)
                    self.emit(Event("check_error", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                    segment=loc.segment, token_start=loc.token_start, num_tokens=loc.num_tokens,
                                    reason="check_error", detail=detail(mode="after_write", message=msg.check_error)))
                    report.check_errors += 1
                st.done(wid, sid)
                report.written += 1
                self.space.account(loc.nbytes, loc.num_tokens)
                bar.update(1, loc.num_tokens, loc.nbytes)
            case Failed(sample_id=sid, attempt=attempt, fingerprint=fp, reason=reason, message=message):
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid, reason=reason,
                                detail=detail(message=message)))
                st.done(wid, sid)
                report.failed += 1
                bar.update(1)
            case NoSpace(sample_id=sid, attempt=attempt, fingerprint=fp, message=message):
                self.emit(Event("failed", sample_id=sid, fingerprint=fp, attempt=attempt, worker=wid,
                                reason="no_space", detail=detail(message=message)))
                st.done(wid, sid, requeue=True)  # retried once space returns
                self.space.disk_full()
            case Deferred(sample_id=sid, projected=projected):
                room = self.space.never_fits(projected, msg.total, msg.free)
                if room is None:  # waits until it fits
                    st.done(wid, sid, requeue=True)
                    self.space.flood_block(projected)
                    return
                wm = self.cfg.watermarks
                message = (f"needs {projected} bytes ({human_bytes(projected)}, uncompressed upper bound) but the "
                           f"volume of {self.lay.data} ({human_bytes(msg.total)}) has room for only {room} bytes "
                           f"({human_bytes(room)}) below the flood watermark ({pct(wm.flood)})"
                           + (f" and min_free ({human_bytes(wm.min_free)})" if wm.min_free else "")
                           + " besides the other files on it, even without this build's data; it can never be "
                           "written there: grow or clean the volume, raise --flood, or lower --max-tokens")
                self.emit(Event("failed", sample_id=sid, fingerprint=msg.fingerprint, attempt=msg.attempt,
                                worker=wid, reason="too_big_for_volume",
                                detail=detail(message=message, projected=projected, room=room)))
                self.echo(f"\nsample {sid} failed: too big for the volume: {message}")
                st.done(wid, sid)
                report.failed += 1
                bar.update(1)
            case Skipped(sample_id=sid) | Abandoned(sample_id=sid):
                st.done(wid, sid, requeue=not self.stop_requested)
            case Sealed(info=info):
                self.emit(Event("segment_sealed", worker=wid, segment=info["segment"], num_tokens=info["tokens"],
                                detail=detail(**info)))
            case SealFailed(segment=segment, error=error):
                self.emit(Event("segment_sealed", worker=wid, segment=segment, reason="seal_failed",
                                detail=detail(error=error)))
            case Exit():
                st.alive.discard(wid)

    def _drain(self, w: int, conn: Connection, proc, st: Dispatch, by_id, meta, bar, report) -> None:
        """Handle every message the worker has sent so far, in order. At EOF (its end of the pipe is closed: the
        process is gone) a worker that never said `exit` died."""
        while w in st.alive:
            try:
                if not conn.poll(0):
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                proc.join(timeout=5)
                self._worker_died(w, proc.exitcode, st, report, getattr(proc, "lost", None))
                return
            self._handle(msg, st, by_id, meta, bar, report)

    def _provenance(self, sid: str) -> dict:
        if sid not in self.dump_files:
            return {}
        return {"import": {"file": self.dump_files[sid], "format": self.opts.imports.format}}


def _quant_error(loc) -> dict:
    """The written event's `fp8_error` (an fp8 build: each state field's relative RMS error), else nothing."""
    if not loc.quant_error:
        return {}
    return {"fp8_error": {k: round(v, 6) for k, v in loc.quant_error.items()}}
