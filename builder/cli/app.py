"""`hsbuild`: a thin command line over the library. Only this module prints errors and picks exit codes.

Exit codes: 0 done; 1 finished but some samples failed (run) or damage found (verify); 2 usage error or bad
input (nothing committed changed); 3 the build will not fit on its volume; 4 blocking preflight problem;
130 interrupted (everything committed is safe).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from builder import __version__
from builder.cli import doctor as cli_doctor
from builder.cli import exchange as cli_exchange
from builder.cli import rebuild as cli_rebuild
from builder.cli import report as cli_report
from builder.cli import samples as cli_samples
from builder.cli import verify as cli_verify
from builder.cli.args import (
    BackendNames,
    Parser,
    RegistryHelp,
    add_regen_flags,
    add_run_flags,
    fraction,
    positive_int,
)
from builder.cli.args import fmt_of as _fmt
from builder.cli.args import int_list as _int_list
from builder.cli.args import out_flags as _out_flags
from builder.cli.args import size as _size
from builder.cli.args import workers as _workers
from builder.cli.output import print_json, print_rows
from builder.cli.progress import progress_for
from builder.config import CODEC_SPECS, DEFAULT_CODEC
from builder.errors import EXIT_INTERRUPTED, EXIT_OK, HsbuildError
from builder.humanize import human_bytes, human_seconds, pct


def build_parser() -> argparse.ArgumentParser:
    out = _out_flags()
    ap = Parser(
        prog="hsbuild", description="Crash-safe, storage-aware hidden-state dataset builder",
        epilog="exit codes: 0 done; 1 some samples failed (run) / damage found (verify); 2 usage error or bad input "
               "(nothing changed); 3 will not fit below the high watermark, volume full or not answering; 4 blocking "
               "preflight problem; "
               "130 interrupted (safe; `hsbuild resume` continues)")
    ap.add_argument("--version", action="version", version=f"hsbuild {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="create a build directory")
    p.add_argument("build")
    p.add_argument("--source", required=True, help="JSONL or Parquet file, one sample a row (input_ids, messages/"
                   "conversations or text), or a `datasets` save_to_disk directory (speculators' prepared data)")
    p.add_argument("--model", default="builtin", help="builtin[:hidden=256,layers=8,vocab=1024] or a HF model dir")
    p.add_argument("--aux-layers", type=_int_list, help="hidden_states indices to keep (default: 2, L//2, L-3)")
    p.add_argument("--max-tokens", type=positive_int,
                   help="truncate longer samples to N tokens (at most the model's positions)")
    p.add_argument("--max-attempts", type=positive_int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--codec", default=DEFAULT_CODEC,
                   help=f"{CODEC_SPECS} (default {DEFAULT_CODEC}; -bitshuffle: bit shuffle, else byte shuffle)")
    p.add_argument("--chunk-tokens", type=positive_int, help="chunk length along the token axis (default: measured)")
    p.add_argument("--device", default="auto")
    p.add_argument("--staging", help=RegistryHelp("an existing staging directory: where an engine writes states "
                                                  "({servers}), watched by the disk watermarks too (e.g. /dev/shm/NAME)"))
    p.add_argument("--backend", default="inprocess", choices=BackendNames(),
                   help=RegistryHelp("what runs the forward passes ({described})"))
    p.add_argument("--server", help=RegistryHelp("the inference server's URL, e.g. http://127.0.0.1:8000 ({servers})"))
    p.add_argument("--inflight", type=positive_int, help="requests in flight to the server (default 16)")
    p.add_argument("--batch-tokens", type=positive_int, metavar="N",
                   help="pack samples into forward passes of up to N tokens, generations "
                        "decoded together (--backend inprocess; the same tokens and states, bit for bit; default: one "
                        "sample a pass)")
    p.add_argument("--final-state", default=None, choices=["post_norm", "pre_norm"],
                   help="hidden_state: the final norm's input (an engine's layer L, speculators) or its output (HF "
                   "hidden_states[L], SpecForge, Model-Optimizer); the norm is kept in the build, so post-norm is "
                   "derived from pre-norm bit-exactly (never the reverse). Default: pre_norm, which feeds every "
                   "trainer, where the model allows it (else post_norm, and init says so)")
    p.add_argument("--quantize", default="none", choices=["none", "fp8"],
                   help="fp8: store states lossy as float8_e4m3fn with a float32 scale a token (about half the "
                   "bytes; read back dequantized, each sample's error in its written event); default: exact")
    p.add_argument("--low", type=fraction, default=0.85)
    p.add_argument("--high", type=fraction, default=0.90)
    p.add_argument("--flood", type=fraction, default=0.95)
    p.add_argument("--min-free", type=_size, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing build (deletes its data)")
    p.add_argument("--allow-overcommit", action="store_true", help="do not warn that the build will not fit")
    add_regen_flags(p)

    for name, helptext in (("run", "extract samples (continues where the log says it stopped)"),
                           ("resume", "replay the log, report what it found, then continue")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("build")
        add_run_flags(p)

    p = sub.add_parser("status", help="progress, failures, disk; works during a run", parents=[out])
    p.add_argument("build")

    p = sub.add_parser("sql", help="read-only SQL over the event log and views (samples, progress, runs)",
                       parents=[out])
    p.add_argument("build")
    p.add_argument("query")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="stop the query after this long (default 30)")

    cli_rebuild.add_commands(sub, out)

    p = sub.add_parser("serve-command", help="print the exact inference-server command for this build",
                       description="Prints the exact command that starts this build's inference server, returning "
                                   "its layers into its staging folder (with the engine flags that requires). Add "
                                   "engine flags such as --tensor-parallel-size 8 with `engine_args` in hsbuild.toml.")
    p.add_argument("build")

    p = sub.add_parser("demo", help="init + run on the built-in model and sample set, then print status")
    p.add_argument("build", nargs="?", default="hsbuild-demo")
    p.add_argument("--samples", type=positive_int, default=300)
    p.add_argument("--workers", type=_workers, default="auto", metavar="N|auto")
    p.add_argument("--no-progress", action="store_true")

    cli_exchange.add_commands(sub, out)
    cli_samples.add_commands(sub, out)
    cli_verify.add_commands(sub, out)
    cli_doctor.add_commands(sub, out)
    cli_report.add_commands(sub, out)
    return ap


# ---------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from builder.config import BuildConfig, Watermarks  # noqa: PLC0415
    from builder.extract.backends import registry as backends  # noqa: PLC0415
    from builder.formats.build_info import BuildInfo  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415
    from builder.space.capacity import describe_capacity  # noqa: PLC0415

    backends.check_options(backends.choose(args.backend), {"batch_tokens": args.batch_tokens})
    lay = init_build(args.build, args.source, model=args.model, aux_layers=args.aux_layers, max_tokens=args.max_tokens,
                     force=args.force, codec=args.codec, dtype=args.dtype, chunk_tokens=args.chunk_tokens,
                     max_attempts=args.max_attempts, device=args.device, staging=args.staging,
                     watermarks=Watermarks(args.low, args.high, args.flood, args.min_free), backend=args.backend,
                     server=args.server, inflight=args.inflight, final_state=args.final_state,
                     quantize=args.quantize, regenerate=args.regenerate, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed, turns=args.turns,
                     drop_truncated=args.drop_truncated)
    if args.batch_tokens is not None:  # not a format key: the states are the same, bit for bit
        cfg = BuildConfig.from_toml(lay.config)
        cfg.batch_tokens = args.batch_tokens
        cfg.save(lay.config)
    print(f"created build {lay.root}")
    for line in BuildInfo.load(lay).feeds():  # the final state, the trainers it feeds, their layer flags
        print(line)
    if args.quantize == "fp8":
        print("states stored as fp8 (float8_e4m3fn, a float32 scale a token): lossy, about half the bytes; each "
              "sample's error is recorded in its written event, and every export says so (hsbuild-lossy.json)")
    for line in describe_capacity(lay):
        print(line)
    return EXIT_OK


def cmd_run(args: argparse.Namespace, resume: bool = False) -> int:
    # the run prepared once (builder/run/preparation.py: the workers counted, the backend asked), before the
    # coordinator's module is imported, and its local workers started with that count: the seconds they and the
    # coordinator spend importing torch overlap (builder/run/standby.py)
    from builder.run.preparation import RunOptions, prepare  # noqa: PLC0415

    opts = RunOptions(workers=args.workers, limit=args.limit, max_attempts=args.max_attempts, device=args.device,
                      verify_after_write=args.verify_after_write, allow_overcommit=args.allow_overcommit,
                      force=args.force, progress=progress_for(args), low=args.low, high=args.high,
                      flood=args.flood, min_free=args.min_free, take_over=args.take_over, launch=args.launch,
                      inflight=args.inflight, source=args.source, accept_source_changes=args.accept_source_changes,
                      ray=args.ray, trust_server=args.trust_server, metrics=args.metrics)
    # a resume with nothing to do is answered from the log before any worker starts (run/settled.py)
    prepared = prepare(args.build, opts, start_workers=not resume)
    if resume:
        from builder.run.preparation import with_standby  # noqa: PLC0415
        from builder.run.settled import resume_settled  # noqa: PLC0415

        done = resume_settled(prepared)
        if done is not None:
            print(done.line(), file=sys.stderr)
            print(f"nothing to do: {done.done} done, {done.retired} retired; wrote 0, failed 0")
            return EXIT_OK
        prepared = with_standby(prepared)
    try:
        return _run(args, resume, prepared)
    finally:
        if prepared.standby is not None:
            prepared.standby.close()


def _run(args: argparse.Namespace, resume: bool, prepared) -> int:  # noqa: ANN001 - a run.preparation.Prepared
    from builder.run.coordinator import run_build  # noqa: PLC0415

    report = run_build(prepared, resume=resume, echo=lambda m: print(m, file=sys.stderr))
    print(f"run {report.run_id[:8]}: {report.outcome}; wrote {report.written}, failed {report.failed}"
          + (f", paused {report.pauses}x" if report.pauses else ""))
    if report.failed_in_build:
        print(f"{report.failed_in_build} sample(s) in the build are failed; see them with: "
              f"hsbuild sql {args.build} \"SELECT sample_id, error, error_detail FROM samples WHERE state='failed'\"")
    if report.outcome == "interrupted":
        print(f"interrupted at a safe point; continue with: hsbuild resume {args.build}")
    if report.outcome == "refused":
        print(f"refused: {'; '.join(report.messages)}")
    if report.outcome == "staging_too_small":  # (nothing committed is lost: a bigger staging volume, then resume)
        print(f"hsbuild {args.cmd}: error: {'; '.join(report.messages)}", file=sys.stderr)
    if report.outcome == "worker_died":
        print(f"{'; '.join(report.messages)}: stopped at a safe point; continue with: hsbuild resume {args.build}")
    return report.exit_code


def status_lines(st: dict) -> list[str]:
    lines = []
    if st.get("running") and st.get("purpose") == "verify" and isinstance(st.get("sweep"), dict):
        sw = st["sweep"]
        lines.append(f"running: verify sweep {str(st.get('run_id', ''))[:8]} (pid {st.get('pid')}): "
                     f"{sw.get('checked')} of {sw.get('selected')} checked")
    elif st.get("running") and st.get("purpose") in ("export", "gc"):
        lines.append(f"running: {st['purpose']} {str(st.get('run_id', ''))[:8]} (pid {st.get('pid')})")
    elif st.get("running"):
        lines.append(f"running: run {str(st.get('run_id', ''))[:8]} (pid {st.get('pid')}, {st.get('workers')} worker(s))")
    else:
        lines.append("idle: no run is going")
    stall = st.get("stalled")
    if stall:
        lines.append(f"STALLED: {stall['what']} pending {stall['pending_s']:.0f} s on {stall['path']} "
                     f"({stall['filesystem']}): writes there do not return (a full Ceph pool or thin volume, a "
                     f"gone NFS server); no new work is sent, nothing is lost; `hsbuild doctor` explains"
                     + ("; the figures below are as of the stall's start" if st.get("stale") else ""))
    elif st.get("running") and st.get("phase", "running") != "running":
        lines.append(f"phase:   {st['phase']}")
    if st.get("stale") and not stall and st.get("as_of"):
        lines.append(f"note:    the figures below are as of {time.strftime('%H:%M:%S', time.localtime(st['as_of']))} "
                     f"({max(time.time() - st['as_of'], 0.0):.0f} s ago): the owner's log did not give newer ones in "
                     "time (a commit to it pending, or a very big log)")
    if st.get("lock_file_missing") or st.get("lock_not_held"):
        what = "is missing" if st.get("lock_file_missing") else "is not held by it (replaced?)"
        lines.append(f"warning: hsbuild.lock {what}, although a process owns this build and answered; nothing "
                     "stops a second run now: do not start one until this one has finished")
    if "total" not in st:  # the owner is still starting (no log open yet): what it is doing
        lines.append(f"phase:   {st.get('phase', 'starting')}")
        return lines
    lines.append(f"samples: {st['total']} total | {st['done']} done ({st['written']} written, {st['verified']} "
                 f"verified) | {st['failed']} failed | {st['started']} in flight/interrupted | {st['pending']} pending"
                 + (f" | {st['retired']} retired (removed from the source or skipped)" if st.get("retired") else ""))
    allowance = st.get("response_allowance")  # a regenerating build: the samples not yet generated estimated
    lines.append(f"tokens:  {st['tokens_done']:,} of {'about ' if allowance is not None else ''}"
                 f"{st['tokens_total']:,} | data {human_bytes(st['bytes_done'])}")
    if allowance is not None:
        lines.append(f"         (each sample not yet generated counted as its first prompt + {allowance:,} tokens: "
                     + ("--max-new-tokens, an upper bound of one response" if st.get("allowance_basis") ==
                        "max_new_tokens" else "the mean the written samples grew by beyond their first prompts")
                     + ")")
    if st.get("failed_by_reason"):
        reasons = ", ".join(f"{k} {v}" for k, v in st["failed_by_reason"].items())
        lines.append(f"failed:  {reasons} (details: SELECT sample_id, error, error_detail FROM samples "
                     "WHERE state = 'failed')")
    if st.get("at_token_limit") or st.get("dropped_at_token_limit"):  # a regenerating build (docs/regenerate.md)
        lines.append(f"responses: {st.get('at_token_limit') or 0} stopped at the token limit (finish_reason length) "
                     f"and kept, {st.get('dropped_at_token_limit') or 0} retired for it (--drop-truncated); see them: "
                     "SELECT sample_id, state, generated FROM samples WHERE finish_reason = 'length'")
    if st.get("requeued"):
        lines.append(f"         ({st['requeued']} of the pending went back to pending after a failure that was not "
                     "theirs: the server, the volume or a node; retried, not counted as attempts)")
    if st.get("running") and st.get("paused"):
        since = f" for {human_seconds(st['paused_for_s'])}" if st.get("paused_for_s") else ""
        lines.append(f"PAUSED:  {st.get('pause_reason')}{since}"
                     + (f": {st['pause_message']}" if st.get("pause_message") else ""))
    rate = st.get("recent_samples_per_s")
    if st.get("running") and rate:
        tps = st.get("recent_tokens_per_s")
        lines.append(f"rate:    {rate:.2f} samples/s" + (f", {tps:,.0f} tokens/s" if tps else "")
                     + (" | ETA: none while paused" if st.get("paused") else
                        f" | ETA {human_seconds(st.get('eta_seconds'))}"))
    if st.get("running") and st.get("backend"):
        health = "healthy" if st.get("server_healthy") else "UNAVAILABLE (run paused)"
        lines.append(f"engine:  {st['backend']} {st.get('server')} {health}"
                     + (f", restarted {st['server_restarts']}x" if st.get("server_restarts") else "")
                     + f" | {st.get('in_flight', 0)} request(s) in flight | staging {st.get('staging_files', 0)} "
                     f"file(s), {human_bytes(st.get('staging_bytes', 0))}")
    lr = st.get("last_run")
    if lr and lr.get("duration_s") is not None:
        going = st.get("running") and lr.get("outcome") == "unfinished"
        what = "this run" if going else f"last {'sweep' if lr.get('kind') == 'verify' else 'run'} ({lr.get('outcome')})"
        # the rates are over the time spent extracting (pauses, stalls, start-up and the tail left out)
        rates = ""
        if lr.get("written") and lr.get("active_s"):
            rates = (f": {lr.get('samples_per_s') or 0:.2f} samples/s, {lr.get('tokens_per_s') or 0:,.0f} tokens/s, "
                     f"{lr.get('mb_per_s') or 0:.2f} MB/s over {_span(lr['active_s'])} extracting")
        elif lr.get("written"):  # its first start and last write in one commit of the log
            rates = " (too fast to time: the log stamps events at its commits, every 0.5 s)"
        lines.append(f"{'run:':<9}{what}: {_span(lr['duration_s'])}{' so far' if going else ''} (wall), "
                     f"{lr.get('written') or 0} written{rates}")
    if st.get("trust_server"):
        lines.append(f"trust:   {'this' if st.get('running') else 'the last'} run took --trust-server: the server's "
                     f"configuration could not be read ({st['trust_server']}); it was judged by its answers alone")
    if "usage" in st:
        disk = f"disk:    {st['usage']:.1%} used, {human_bytes(st['free_bytes'])} free"
        if st.get("paused") and st.get("pause_reason") in ("high_watermark", "min_free", "flood", "disk_full"):
            disk += f" | PAUSED ({st.get('pause_reason')}): resumes below {pct(st.get('low', 0.85))}"
        lines.append(disk)
    if "projected_bytes" in st:
        fit = "fits" if st.get("fits") else "DOES NOT FIT"
        lines.append(f"plan:    {human_bytes(st['projected_bytes'])} more projected ({st.get('basis')}); {fit} below "
                     f"the high watermark")
    for n in st.get("nodes", []):
        rate = f", {n['samples_per_s']:.2f} samples/s" if n.get("samples_per_s") else ""
        gone = (f" | GONE since {str(n.get('lost_at'))[:19].replace('T', ' ')} ({n['workers_lost']} worker(s) lost; their samples "
                "went back to pending)" if n.get("state") == "gone" else
                f" | {n['workers_lost']} worker(s) lost" if n.get("workers_lost") else "")
        lines.append(f"node:    {str(n.get('node'))[:12]} ({n.get('host')}): {n['workers']} worker(s), "
                     f"{n['written']} written{rate}{gone}")
    if "ballast_bytes" in st:
        held = human_bytes(st["ballast_bytes"]) if st["ballast_bytes"] else "none now (a run creates it)"
        lines.append(f"ballast: {held} in .ballast: {st.get('ballast_purpose')}")
    return lines


def _span(s: float) -> str:
    """Seconds for people: '4.2 s' under a minute, else as human_seconds."""
    return f"{s:.1f} s" if s < 60 else human_seconds(s)


# the nodes of the last run on Ray (none for a local run)
LAST_RUN_NODES = ("SELECT * FROM nodes WHERE run_id = (SELECT arg_max(run_id, seq) FROM events "
                  "WHERE kind = 'worker_placed')")
# the last run (or verify sweep): how long it took and how fast it went (the `runs` view)
# (by the log's order, not by wall time: after the clock was set back, a later run starts "earlier")
LAST_RUN = ("SELECT run_id, kind, outcome, started_at, finished_at, written, tokens, nbytes, duration_s, active_s, "
            "samples_per_s, tokens_per_s, mb_per_s FROM runs ORDER BY started_seq DESC LIMIT 1")
# why the last run that probed a server trusted it (--trust-server: its configuration could not be read); NULL when
# it did not
LAST_RUN_TRUST = ("SELECT max(json_extract_string(detail, '$.trusted')) FROM events WHERE kind = "
                  "'engine_probe' AND run_id = (SELECT arg_max(run_id, seq) FROM events WHERE kind = 'engine_probe')")


def _so_far(run: dict | None) -> None:
    """The going run's duration is until now, not until its last event (a paused run writes none)."""
    import datetime as dt  # noqa: PLC0415

    from builder.log.events import utcnow  # noqa: PLC0415

    start = run.get("started_at") if run else None
    if run is None or run.get("outcome") != "unfinished" or start is None:
        return
    start = dt.datetime.fromisoformat(start) if isinstance(start, str) else start
    run["duration_s"] = round(max((utcnow() - start).total_seconds(), run.get("duration_s") or 0.0), 3)


def cmd_status(args: argparse.Namespace) -> int:
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.query import run_query, status_snapshot  # noqa: PLC0415
    from builder.space.capacity import capacity_of  # noqa: PLC0415
    from builder.space.probe import require_answering  # noqa: PLC0415
    from builder.space.watermarks import ballast_info  # noqa: PLC0415

    lay = layout(args.build)
    require_answering(lay)  # a volume that does not answer: one line within HSBUILD_STALL_S, not a hang
    lay.require()

    def offline_extra(log, prog: dict) -> dict:  # with no owner: all of it from one open log
        trust = log.query(LAST_RUN_TRUST)[1]
        return {**capacity_of(lay, log, prog), "nodes": log.query_dicts(LAST_RUN_NODES),
                "last_run": (log.query_dicts(LAST_RUN) or [None])[0],
                **({"trust_server": trust[0][0]} if trust and trust[0][0] else {})}

    # one pass over the fold: the progress row carries the projection's inputs and the failures per reason
    st = status_snapshot(lay, offline_extra=offline_extra)
    st.update(ballast_info(lay))
    st["failed_by_reason"] = dict(sorted((st.get("failed_by_reason") or {}).items(), key=lambda kv: (-kv[1], kv[0])))
    if "nodes" not in st:  # a run is going: ask it
        cols, rows = run_query(lay, LAST_RUN_NODES)
        st["nodes"] = [dict(zip(cols, r, strict=True)) for r in rows]
    if not st["nodes"]:  # only a run on Ray has nodes
        del st["nodes"]
    if "last_run" not in st:  # a run is going: ask it (its own row: so far)
        cols, rows = run_query(lay, LAST_RUN)
        st["last_run"] = dict(zip(cols, rows[0], strict=True)) if rows else None
        _so_far(st["last_run"])
    fmt = _fmt(args)
    if fmt == "json":
        print_json(st)
    elif fmt == "csv":
        keys = sorted(st)
        print_rows(keys, [[st[k] for k in keys]], "csv")
    else:
        print("\n".join(status_lines(st)))
    return EXIT_OK


def cmd_sql(args: argparse.Namespace) -> int:
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.query import run_query  # noqa: PLC0415
    from builder.space.probe import require_answering  # noqa: PLC0415

    lay = layout(args.build)
    require_answering(lay)  # a volume that does not answer: one line within HSBUILD_STALL_S, not a hang
    cols, rows = run_query(lay.require(), args.query, timeout=args.timeout,
                           on_note=lambda m: print(m, file=sys.stderr))
    print_rows(cols, rows, _fmt(args))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from builder.extract.demo import write_demo_chats, write_demo_source  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415
    from builder.log.query import status_snapshot  # noqa: PLC0415
    from builder.run.coordinator import RunOptions, run_build  # noqa: PLC0415
    from builder.run.create import init_build  # noqa: PLC0415

    lay = layout(args.build)
    if lay.exists():
        print(f"continuing the demo build in {lay.root}")
    else:
        src = write_demo_source(lay.root / "demo-source.jsonl", n=args.samples)
        init_build(lay.root, src, model="builtin", force=True)
        print(f"created demo build {lay.root} ({args.samples} samples, built-in model)")
    report = run_build(lay.root, RunOptions(workers=args.workers, progress=progress_for(args)),
                       echo=lambda m: print(m, file=sys.stderr))
    print(f"run {report.run_id[:8]}: {report.outcome}; wrote {report.written}, failed {report.failed}")
    print("\n".join(status_lines(status_snapshot(lay))))
    # the hint names hsbuild as it was run (`.venv/bin/hsbuild` when the venv is not on PATH), so it works as printed
    import shutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    hsb = sys.argv[0] if Path(sys.argv[0]).name == "hsbuild" else "hsbuild"
    on_path = shutil.which("hsbuild")
    if on_path and Path(hsb).exists() and Path(on_path).resolve() == Path(hsb).resolve():
        hsb = "hsbuild"
    print(f"next: {shlex.quote(hsb)} sql {shlex.quote(args.build)} \"SELECT state, count(*) FROM samples GROUP BY state\"")
    # regeneration (docs/regenerate.md): the built-in model answers a few conversations, their states captured
    chats = shlex.quote(str(write_demo_chats(lay.root / "demo-chats.jsonl")))
    regen = shlex.quote(str(lay.root) + "-regen")
    print(f"next: {shlex.quote(hsb)} init {regen} --source {chats} --regenerate --max-new-tokens 32 --force && "
          f"{shlex.quote(hsb)} run {regen}   # the model's own responses, and their states, in one pass")
    return report.exit_code


def cmd_serve_command(args: argparse.Namespace) -> int:

    from builder.config import load_config  # noqa: PLC0415
    from builder.errors import UsageError  # noqa: PLC0415
    from builder.extract.backends.registry import of_config, with_server  # noqa: PLC0415
    from builder.extract.backends.serving import printable  # noqa: PLC0415
    from builder.extract.build_meta import recorded_meta  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415

    lay = layout(args.build).require()
    cfg = load_config(lay)
    backend = of_config(cfg, lay.config)
    if backend.server is None:
        raise UsageError(f"{lay.root}: its backend is {backend.name} ({backend.summary}), no server to start; "
                         f"make a build with --backend {' or '.join(with_server())} --server URL --staging DIR")
    print(printable(backend.server.plan(cfg, recorded_meta(lay))))
    return EXIT_OK


COMMANDS = {"serve-command": cmd_serve_command, "init": cmd_init, "run": cmd_run, "resume": lambda a: cmd_run(a, resume=True), "status": cmd_status,
            "sql": cmd_sql, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except HsbuildError as e:  # HSBUILD_FORMATS names a format that does not load
        print(f"hsbuild: error: {e}", file=sys.stderr)
        return e.exit_code
    args = parser.parse_args(argv)
    handler = {**COMMANDS, **cli_verify.COMMANDS, **cli_doctor.COMMANDS, **cli_exchange.COMMANDS,
               **cli_samples.COMMANDS, **cli_rebuild.COMMANDS, **cli_report.COMMANDS}[args.cmd]
    try:
        return handler(args)
    except HsbuildError as e:
        print(f"hsbuild {args.cmd}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
