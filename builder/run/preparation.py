"""Before the run's loop: the source it reads (moved with --source, changed rows refused or accepted), the log
caught up with the data (samples durable but not logged, adopted), samples interrupted too often given up, and
after an import, its record. Part of the Coordinator (builder/run/coordinator.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from builder.config import load_config
from builder.errors import SourceChangedError, SourceError, UsageError
from builder.log.events import Event, detail
from builder.run.plan import INTERRUPTED_EXTRA, Plan
from builder.run.rebuild import adopt, unlogged
from builder.run.source_changes import diff_source, record_source, refusal

if TYPE_CHECKING:
    from builder.extract.source import Sample
    from builder.run.coordinator import RunReport


class PreparationMixin:
    """(Mixed into Coordinator: uses its log, events, echo and options.)"""

    def _source_path(self) -> Path:
        """The source to read: --source (a moved source), else hsbuild.toml's."""
        if self.opts.source is not None:
            new = Path(self.opts.source).absolute()
            if not new.exists():
                raise UsageError(f"--source {self.opts.source}: not found; pass the path the build's source file "
                                 "now has")
            return new
        old = Path(self.cfg.source)
        if not old.exists():
            raise SourceError(str(old), f"the build's source is not there; if it moved, pass its new path: "
                              f"`hsbuild resume {self.lay.root} --source NEWPATH` (its rows must be the registered "
                              "ones, or add --accept-source-changes), else restore the file")
        return old

    def _check_source(self, samples: list[Sample]) -> int:
        """Compare the source with the registered samples: new ones are registered; changed or removed ones
        are refused, unless accepted (--accept-source-changes), then recorded. A moved source (--source) is
        recorded too, and hsbuild.toml updated. Returns how many samples were new."""
        diff = diff_source(self.log, samples)
        moved = Path(self.cfg.source).absolute() != self.source.absolute()
        if diff.needs_acceptance and not self.opts.accept_source_changes:
            err = refusal(diff, self.lay.root)
            if moved:
                err = SourceChangedError(f"--source {self.source} does not hold the build's registered samples "
                                         f"as they were ({diff.describe()}); if it is the build's source, edited, "
                                         "add --accept-source-changes; else pass the right file")
            raise err
        if moved:
            self.emit(Event("source_moved", detail=detail(source=str(self.source), previous=self.cfg.source)))
        record_source(self.log, samples, diff, self.emit, str(self.source))
        self.flush(force=True)
        if moved:  # after the log has it; only the source line changes (not this run's flag overrides)
            saved = load_config(self.lay)
            saved.source = self.cfg.source = str(self.source)
            saved.save(self.lay.config)
            self.echo(f"source moved: now {self.source} (recorded in the log; hsbuild.toml updated)")
        if diff.needs_acceptance:
            self.echo(f"source changes accepted: {diff.describe()}; changed samples are extracted again, removed "
                      "ones retired (recorded in the log: SELECT * FROM samples WHERE state = 'retired')")
        return len(diff.added)

    def _adopt_unlogged(self, previous: dict | None = None) -> None:
        """Samples durable in a segment (its manifest says so) whose `written` event the log lacks: a crash
        between the data barrier and the log commit, or a log that lost commits. Adopt them once their bytes
        check out, rather than extracting them again."""
        missed = unlogged(self.log, self.lay.data)
        if not missed:
            return
        rep = adopt(self.log, self.lay.data, self.emit, missed)
        self.emit(Event("adopted", detail=detail(found=len(missed), adopted=len(rep.adopted), damaged=rep.damaged,
                                                 stale=rep.stale)))
        self.flush(force=True)
        why = ("the previous run was interrupted (Ctrl-C twice) before its log committed them"
               if previous and previous.get("interrupted") else "a crash before the log's commit, or a lost log file")
        self.echo(f"the log was behind the data: {len(missed)} durable sample(s) had no `written` event ({why}); "
                  f"adopted {len(rep.adopted)} after reading them back"
                  + (f"; {len(rep.damaged)} failed the check and are extracted again" if rep.damaged else ""))

    def _give_up_interrupted(self, plan: Plan) -> None:
        """Record the samples left in flight too often as failed, with the reason, so `status`, the `samples`
        view and later plans show why they are no longer tried."""
        limit = self.cfg.max_attempts + INTERRUPTED_EXTRA
        for sid in plan.interrupted_final:
            n = plan.attempts[sid]
            self.emit(Event("failed", sample_id=sid, attempt=n, reason="interrupted_too_often", detail=detail(
                attempts=n, limit=limit, message=(
                    f"started {n} times without being written, the last time left in flight by a run that ended "
                    f"abruptly (crash, OOM kill, kill -9); given up at {limit} starts (--max-attempts + "
                    f"{INTERRUPTED_EXTRA}): find what kills the run on this sample, or raise --max-attempts to try "
                    "it again"))))
        if plan.interrupted_final:
            self.echo(f"given up on {len(plan.interrupted_final)} sample(s) interrupted too often (e.g. "
                      f"{', '.join(plan.interrupted_final[:3])}): started {limit} times or more, left in flight by "
                      "runs that ended abruptly; recorded as failed (interrupted_too_often)")

    def _record_import(self, report: RunReport) -> None:
        """The `import` event: what was matched and imported, and every file that was not usable, with why."""
        self.flush(force=True)
        cols, rows = self.log.query(
            "SELECT sample_id, reason, json_extract_string(detail, '$.message') FROM events "
            "WHERE run_id = ? AND kind = 'failed' AND reason LIKE 'import_%' ORDER BY seq", [self.run_id])
        report.rejected = [{"sample_id": r[0], "reason": r[1].removeprefix("import_"), "message": r[2],
                            "path": self.dump_files.get(r[0])} for r in rows]
        d = report.dump
        self.emit(Event("import", detail=detail(
            dir=str(Path(self.opts.imports.dir).absolute()), format=self.opts.imports.format, scanned=d.scanned,
            matched=len(d.files), imported=report.written, rejected=report.rejected,
            unusable=[p.__dict__ for p in d.problems], dump_layers=d.claim.as_dict() if d.claim else None,
            **({"duplicates": [p.__dict__ for p in d.duplicates]} if d.duplicates else {}))))
        self.flush(force=True)

    def _match_dump(self, plan: Plan, report: RunReport, samples: list[Sample]) -> None:
        """An import: index the dump's files against the source; only the samples a file holds are done."""
        from builder.exchange.imports import index_dump  # noqa: PLC0415

        report.dump = index_dump(self.opts.imports, samples, self.cfg.max_tokens, self.dump_claim)
        self.dump_files = report.dump.files
        plan.todo = [s for s in plan.todo if s.sample_id in self.dump_files][: self.opts.limit]
        done = len(self.dump_files) - len(plan.todo)  # (every file matched a source sample)
        self.echo(f"import: {report.dump.scanned} file(s) in {self.opts.imports.dir}, "
                  f"{len(self.dump_files)} sample(s) matched ({max(done, 0)} already in the build), "
                  f"{len(report.dump.problems)} file(s) unusable; {len(plan.todo)} to import now")
        dups = report.dump.duplicates
        if dups:  # harmless: the same tokens and states as the file imported
            self.echo(f"import: {len(dups)} duplicate file(s) not imported (the same tokens and states as the file "
                      f"imported): " + ", ".join(d.path for d in dups[:3]) + (" ..." if len(dups) > 3 else ""))

    def _say_replayed(self, plan: Plan, resume: bool, added: int) -> None:
        """What replaying the log found, when there is anything to say (a resume, or a build begun before)."""
        if resume or plan.done or plan.interrupted or plan.interrupted_final or plan.failed_retry or plan.damaged:
            self.echo(
                f"replayed {self.log._seq} events: {plan.done} done, {len(plan.interrupted)} interrupted in flight"
                + (f" (+{len(plan.interrupted_final)} interrupted too often: given up)"
                   if plan.interrupted_final else "")
                + f", {len(plan.failed_retry) + len(plan.failed_final)} failed ({len(plan.failed_retry)} to retry), "
                f"{len(plan.damaged)} damaged (re-extract), {len(plan.pending)} pending; "
                f"{len(plan.todo)} to do now" + (f" (+{added} new in source)" if added else "")
            )


def tokenizer_for(cfg):  # noqa: ANN001, ANN201 - (BuildConfig; a tokenizer)
    """The build's tokenizer, for its source (loaded only when a row needs it)."""
    from builder.extract.spec import BuiltinSpec, HfTokenizer, builtin_tokenizer, is_builtin  # noqa: PLC0415

    if is_builtin(cfg.model):
        return builtin_tokenizer(BuiltinSpec.parse(cfg.model).vocab)
    return HfTokenizer(Path(cfg.model))  # loaded at its first use: sources of input_ids never need it
