"""The log caught up, before the run's loop: the source it reads (moved with --source, changed rows refused or
accepted), samples durable in the data but not in the log adopted, samples interrupted too often given up, what
replaying the log found said; for an import, the dump matched to the source, and its record once the run is done.

`CatchUp` holds what these steps share (the run's start, its owner session, where it says things) and nothing
that changes; each step is one call, its result returned.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import load_config
from builder.errors import SourceChangedError, SourceError, UsageError
from builder.log.events import Event, detail
from builder.run.plan import INTERRUPTED_EXTRA, Plan
from builder.run.rebuild import adopt, unlogged, unlogged_drops
from builder.run.source_changes import diff_source, record_source, refusal

if TYPE_CHECKING:
    from builder.exchange.imports import DumpIndex
    from builder.extract.source import Sample
    from builder.log.session import OwnerSession
    from builder.run.preparation import Prepared


class CatchUp:
    def __init__(self, prep: Prepared, session: OwnerSession, echo: Callable[[str], None]):
        self._prep, self._session, self._echo = prep, session, echo

    def _emit(self, ev: Event) -> None:
        self._session.emit(ev)

    def source_path(self) -> Path:
        """The source to read: --source (a moved source), else hsbuild.toml's."""
        prep = self._prep
        if prep.opts.source is not None:
            new = Path(prep.opts.source).absolute()
            if not new.exists():
                raise UsageError(f"--source {prep.opts.source}: not found; pass the path the build's source file "
                                 "now has")
            return new
        old = Path(prep.cfg.source)
        if not old.exists():
            raise SourceError(str(old), f"the build's source is not there; if it moved, pass its new path: "
                              f"`hsbuild resume {prep.lay.root} --source NEWPATH` (its rows must be the registered "
                              "ones, or add --accept-source-changes), else restore the file")
        return old

    def check_source(self, source: Path, samples: list[Sample]) -> tuple[int, bool]:
        """Compare the source with the registered samples: new ones are registered; changed or removed ones
        are refused, unless accepted (--accept-source-changes), then recorded. A moved source (--source) is
        recorded too, and hsbuild.toml updated (the run then goes on with `Prepared.moved_to`). Returns how many
        samples were new, and whether the source moved."""
        prep, log = self._prep, self._session.log
        diff = diff_source(log, samples)
        moved = Path(prep.cfg.source).absolute() != source.absolute()
        if diff.needs_acceptance and not prep.opts.accept_source_changes:
            err = refusal(diff, prep.lay.root)
            if moved:
                err = SourceChangedError(f"--source {source} does not hold the build's registered samples "
                                         f"as they were ({diff.describe()}); if it is the build's source, edited, "
                                         "add --accept-source-changes; else pass the right file")
            raise err
        if moved:
            self._emit(Event("source_moved", detail=detail(source=str(source), previous=prep.cfg.source)))
        record_source(log, samples, diff, self._emit, str(source))
        self._session.flush(force=True)
        if moved:  # after the log has it; only the source line changes (not this run's flag overrides)
            saved = load_config(prep.lay)
            saved.source = str(source)
            saved.save(prep.lay.config)
            self._echo(f"source moved: now {source} (recorded in the log; hsbuild.toml updated)")
        if diff.needs_acceptance:
            self._echo(f"source changes accepted: {diff.describe()}; changed samples are extracted again, removed "
                       "ones retired (recorded in the log: SELECT * FROM samples WHERE state = 'retired')")
        return len(diff.added), moved

    def adopt_unlogged(self, previous: dict | None = None) -> None:
        """Samples durable in a segment (its manifest says so) whose `written` event the log lacks: a crash
        between the data barrier and the log commit, or a log that lost commits. Adopt them once their bytes
        check out, rather than extracting them again."""
        log, data = self._session.log, self._prep.lay.data
        missed = unlogged(log, data)
        if not missed:
            return
        rep = adopt(log, data, self._emit, missed)
        self._emit(Event("adopted", detail=detail(found=len(missed), adopted=len(rep.adopted), damaged=rep.damaged,
                                                  stale=rep.stale)))
        self._session.flush(force=True)
        why = ("the previous run was interrupted (Ctrl-C twice) before its log committed them"
               if previous and previous.get("interrupted") else "a crash before the log's commit, or a lost log file")
        self._echo(f"the log was behind the data: {len(missed)} durable sample(s) had no `written` event ({why}); "
                   f"adopted {len(rep.adopted)} after reading them back"
                   + (f"; {len(rep.damaged)} failed the check and are extracted again" if rep.damaged else ""))

    def adopt_drops(self) -> None:
        """Responses dropped with --drop-truncated whose `drop` history record is durable but whose `retired`
        events the log lacks (a crash between the two): retired now, as the record says, never generated again."""
        events = unlogged_drops(self._session.log, self._prep.lay.data)
        if not events:
            return
        for ev in events:
            self._emit(ev)
        self._session.flush(force=True)
        self._echo(f"the log was behind the data: {len(events)} dropped response(s) (--drop-truncated) recorded in "
                   "data/history/ had no `retired` event (a crash before the log's commit); retired now")

    def give_up_interrupted(self, plan: Plan) -> None:
        """Record the samples left in flight too often as failed, with the reason, so `status`, the `samples`
        view and later plans show why they are no longer tried."""
        limit = self._prep.cfg.max_attempts + INTERRUPTED_EXTRA
        for sid in plan.interrupted_final:
            n = plan.attempts[sid]
            self._emit(Event("failed", sample_id=sid, attempt=n, reason="interrupted_too_often", detail=detail(
                attempts=n, limit=limit, message=(
                    f"started {n} times without being written, the last time left in flight by a run that ended "
                    f"abruptly (crash, OOM kill, kill -9); given up at {limit} starts (--max-attempts + "
                    f"{INTERRUPTED_EXTRA}): find what kills the run on this sample, or raise --max-attempts to try "
                    "it again"))))
        if plan.interrupted_final:
            self._echo(f"given up on {len(plan.interrupted_final)} sample(s) interrupted too often (e.g. "
                       f"{', '.join(plan.interrupted_final[:3])}): started {limit} times or more, left in flight by "
                       "runs that ended abruptly; recorded as failed (interrupted_too_often)")

    def say_replayed(self, plan: Plan, resume: bool, added: int) -> None:
        """What replaying the log found, when there is anything to say (a resume, or a build begun before)."""
        if resume or plan.done or plan.interrupted or plan.interrupted_final or plan.failed_retry or plan.damaged:
            self._echo(
                f"replayed {self._session.log.last_seq} events: {plan.done} done, {len(plan.interrupted)} "
                "interrupted in flight"
                + (f" (+{len(plan.interrupted_final)} interrupted too often: given up)"
                   if plan.interrupted_final else "")
                + f", {len(plan.failed_retry) + len(plan.failed_final)} failed ({len(plan.failed_retry)} to retry), "
                f"{len(plan.damaged)} damaged (re-extract), {len(plan.pending)} pending; "
                f"{len(plan.todo)} to do now" + (f" (+{added} new in source)" if added else "")
            )

    # -- an import -----------------------------------------------------------------------------------------------
    def match_dump(self, plan: Plan, samples: list[Sample]) -> DumpIndex:
        """An import: index the dump's files against the source; only the samples a file holds are done (the
        plan's `todo` narrowed to them)."""
        from builder.exchange.imports import index_dump  # noqa: PLC0415

        prep = self._prep
        imports = prep.opts.imports
        dump = index_dump(imports, samples, prep.cfg.max_tokens, prep.dump_claim)
        plan.todo = [s for s in plan.todo if s.sample_id in dump.files][: prep.opts.limit]
        done = len(dump.files) - len(plan.todo)  # (every file matched a source sample)
        self._echo(f"import: {dump.scanned} file(s) in {imports.dir}, "
                   f"{len(dump.files)} sample(s) matched ({max(done, 0)} already in the build), "
                   f"{len(dump.problems)} file(s) unusable; {len(plan.todo)} to import now")
        dups = dump.duplicates
        if dups:  # harmless: the same tokens and states as the file imported
            self._echo(f"import: {len(dups)} duplicate file(s) not imported (the same tokens and states as the "
                       "file imported): " + ", ".join(d.path for d in dups[:3]) + (" ..." if len(dups) > 3 else ""))
        return dump

    def record_import(self, run_id: str, dump: DumpIndex, imported: int) -> list[dict]:
        """The `import` event: what was matched and `imported`, and every file that was not usable, with why.
        Returns the files a worker refused (sample, reason, message, path)."""
        self._session.flush(force=True)
        imports = self._prep.opts.imports
        cols, rows = self._session.log.query(
            "SELECT sample_id, reason, json_extract_string(detail, '$.message') FROM events "
            "WHERE run_id = ? AND kind = 'failed' AND reason LIKE 'import_%' ORDER BY seq", [run_id])
        rejected = [{"sample_id": r[0], "reason": r[1].removeprefix("import_"), "message": r[2],
                     "path": dump.files.get(r[0])} for r in rows]
        self._emit(Event("import", detail=detail(
            dir=str(Path(imports.dir).absolute()), format=imports.format, scanned=dump.scanned,
            matched=len(dump.files), imported=imported, rejected=rejected,
            unusable=[p.__dict__ for p in dump.problems], dump_layers=dump.claim.as_dict() if dump.claim else None,
            **({"duplicates": [p.__dict__ for p in dump.duplicates]} if dump.duplicates else {}))))
        self._session.flush(force=True)
        return rejected
