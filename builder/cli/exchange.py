"""`hsbuild export` and `hsbuild import`: a build in the files trainers read, and trainers' dumps into a build.

Exit codes: export 0 every selected sample is in the export; 1 some are not (damaged, failed or not yet written:
listed; repair them and run the same export again, which adds them); 2 usage error (also an OUT that cannot hold
an export: under a file, on a kernel filesystem such as /proc or /sys, not writable); 3 the export does not fit
below the target's high watermark, or its volume filled up (free space, run it again: it continues); 5 busy
(another process owns the build); 130 interrupted (the same command continues). A build that cannot be written
(a read-only mount) is exported all the same, and the export is not recorded in its log (said on stderr).
Import: 0 every matched file imported; 1 some files were unusable (listed: their samples are left for `hsbuild
resume`); 2 also when the dump's layers are unknown (no metadata, no --dump-layers); 4 the dump is not the
build's (other layers, or states of another width), nothing imported; otherwise as `run`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from builder.cli.args import add_run_flags, fraction, int_list, positive_int
from builder.cli.args import fmt_of as _fmt
from builder.cli.output import print_json, print_rows
from builder.cli.progress import progress_for
from builder.errors import EXIT_OK, EXIT_SAMPLES_FAILED
from builder.formats import registry
from builder.formats.numbering import LAYER_CONVENTIONS, NUMBERINGS, ids_name
from builder.humanize import human_bytes


def formats_help(exports: bool | None = None, imports: bool | None = None) -> str:
    """Each format's files, from the registry: "specforge: rows_*/data_N.ckpt (...); speculators: ..."."""
    return "; ".join(f"{f.name}: {f.summary}" for f in registry.formats(exports, imports))


def default_conventions() -> str:
    """Which numbering each importing format's --dump-layers default is in: "specforge, modelopt, pt: decoder; ..."."""
    by: dict[str, list[str]] = {}
    for f in registry.formats(imports=True):
        by.setdefault(NUMBERINGS[f.layer_convention][0], []).append(f.name)
    return "; ".join(f"{', '.join(names)}: {short}" for short, names in by.items())


def add_commands(sub, out) -> None:
    p = sub.add_parser("export", parents=[out], help="write the build's samples in a trainer's own files",
                       description="Writes the live samples (read through their checksums) as the trainer reads "
                                   "them. " + formats_help(exports=True) + ". Run the same command again to bring OUT "
                                   "up to date with the build (new and changed samples written, those no longer live "
                                   "removed, files renumbered); it also finishes an interrupted export.")
    p.add_argument("build")
    p.add_argument("out", help="an empty or new directory, or an earlier export of the same options")
    p.add_argument("--format", required=True, choices=registry.names(exports=True))
    p.add_argument("--subset", metavar="n/t", help="export the n-th of t fixed parts of the samples")
    p.add_argument("--limit", type=positive_int, help="export at most N samples")
    p.add_argument("--draft-vocab-size", type=positive_int, metavar="D",
                   help="also write the d2t/t2d mapping of a reduced draft vocabulary of D tokens")
    p.add_argument("--compress", type=int, choices=range(1, 10), metavar="LEVEL",
                   help=registry.option_help("compress"))
    p.add_argument("--allow-overcommit", action="store_true",
                   help="start even if the export does not fit below the target's high watermark (it pauses)")
    p.add_argument("--low", type=fraction, help="resume below this usage of the target volume (build's, 0.85)")
    p.add_argument("--high", type=fraction, help="pause at this usage of the target volume (build's, 0.90)")
    p.add_argument("--flood", type=fraction, help="never start a file that would cross this usage (build's, 0.95)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--take-over", action="store_true", help="take the build over from an owner on another host")

    p = sub.add_parser("import", parents=[out], help="bring a trainer's (or a script's) dump of states into a build",
                       description="Matches each file of DIR to the build's source samples by its token ids, "
                                   "checks it (loads, keys, shapes, dtype, finite, tokens) and writes it into "
                                   "the build with checksums; unusable files are listed and their samples left "
                                   "for `hsbuild resume`. The files are never modified. "
                                   + formats_help(imports=True) + ".")
    p.add_argument("build")
    p.add_argument("dir", help="the dump's folder")
    p.add_argument("--format", required=True, choices=registry.names(imports=True))
    p.add_argument("--dump-final-state", default="post_norm", choices=["post_norm", "pre_norm"],
                   help=registry.option_help("final_state"))
    p.add_argument("--dump-layers", type=int_list, metavar="IDS",
                   help="the aux layer ids the dump holds, comma-separated, the final state excluded (required "
                        "unless the dump says so itself, as an hsbuild export's hsbuild-export.json does); checked "
                        "against the build's before anything is imported (decoder id -1, the embeddings: "
                        "--dump-layers=-1,0,1)")
    p.add_argument("--dump-layer-convention", choices=LAYER_CONVENTIONS, metavar="CONV",
                   help="the numbering of --dump-layers: hf_hidden_states (hf: HF output_hidden_states index), "
                        "decoder_layer_output (decoder: decoder layer index = hf - 1), "
                        "vllm_eagle_aux_hidden_state_layer_ids (vllm); default: the format's own ("
                        + default_conventions() + ")")
    add_run_flags(p)


def cmd_export(args: argparse.Namespace) -> int:
    from builder.config import load_config  # noqa: PLC0415
    from builder.exchange.export import ExportOptions, export_build  # noqa: PLC0415
    from builder.layout import layout  # noqa: PLC0415

    wm = load_config(layout(args.build).require()).watermarks
    for k in ("low", "high", "flood"):
        if getattr(args, k) is not None:
            setattr(wm, k, getattr(args, k))
    bar = progress_for(args)

    def echo(msg: str) -> None:  # a line of its own, below the bar where one is drawn
        print(("\n" if bar.enabled else "") + msg, file=sys.stderr, flush=True)

    report = export_build(args.build, args.out, ExportOptions(
        format=args.format, subset=args.subset, limit=args.limit, compress=args.compress,
        draft_vocab_size=args.draft_vocab_size, allow_overcommit=args.allow_overcommit, watermarks=wm,
        take_over=args.take_over, progress=bar, echo=echo))
    if not report.recorded:
        print(f"note: {args.build} cannot be written here (read-only mount, or no permission): exported without "
              "writing to it, so this export is not recorded in its log", file=sys.stderr)
    if _fmt(args) == "json":
        print_json(report.as_dict())
    else:
        print(f"export {report.export_id[:8]} ({report.format}) into {report.out}: {report.rows} sample(s) in it; "
              f"{len(report.added)} added, {len(report.rewritten)} rewritten, {len(report.removed)} removed, "
              f"{report.renumbered} renumbered, {report.already} kept ({human_bytes(report.bytes_written)} written)"
              + (f", {len(report.repaired)} repaired (their files in OUT did not match their checksums)"
                 if report.repaired else "")
              + (f", paused {report.pauses}x for space" if report.pauses else ""))
        for what in ("added", "rewritten", "repaired", "removed"):
            ids = getattr(report, what)
            if ids:
                print(f"{what}: " + ", ".join(ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else ""))
        fmt = registry.get(report.format)
        if fmt.states:  # (a format of text holds no states)
            print(f"aux layers ({ids_name(fmt.layer_convention)}): {report.layer_ids}; final state "
                  f"{report.final_state.replace('_', '-')}")
        if report.layer_flag:  # not the trainer's default layers: it must be told
            print(f"{report.format} must be told these layers: {report.layer_flag}")
        if report.lossy:
            from builder.formats.lossy import LOSSY_FILE, describe  # noqa: PLC0415

            print(f"{describe(report.lossy)} (in {LOSSY_FILE})")
        if report.files:
            print("files: " + ", ".join(report.files))
        if report.not_exported:
            _print_not_exported(report.not_exported, shlex.quote(args.build))
    return EXIT_SAMPLES_FAILED if report.not_exported else EXIT_OK


def _print_not_exported(left: list[dict], b: str) -> None:
    """The selected samples left out of the export (stderr), and how to bring them in."""
    print(f"{len(left)} selected sample(s) NOT in the export:", file=sys.stderr)
    print_rows(["sample_id", "state", "reason", "message"],
               [[d["sample_id"], d["state"], d["reason"], d["message"]] for d in left[:50]], "table",
               out=sys.stderr, whole=["sample_id"])
    if len(left) > 50:
        print(f"... and {len(left) - 50} more (--json lists them all)", file=sys.stderr)
    if any(d["state"] == "damaged" for d in left):
        print(f"repair: hsbuild verify {b} && hsbuild resume {b}, then run this export again", file=sys.stderr)
    elif all(d["state"] == "refused" for d in left):  # the format says why (and what to do) in each message
        return
    else:
        print(f"extract them: hsbuild resume {b} (one that can never succeed leaves the selection with: hsbuild "
              f"skip {b} ID --reason WHY), then run this export again", file=sys.stderr)


def cmd_import(args: argparse.Namespace) -> int:
    from builder.exchange.imports import ImportOptions  # noqa: PLC0415
    from builder.run.coordinator import RunOptions, run_build  # noqa: PLC0415

    opts = RunOptions(workers=args.workers, limit=args.limit, max_attempts=args.max_attempts,
                      verify_after_write=args.verify_after_write, allow_overcommit=args.allow_overcommit,
                      force=args.force, progress=progress_for(args), low=args.low, high=args.high,
                      flood=args.flood, min_free=args.min_free, take_over=args.take_over, launch=args.launch,
                      imports=ImportOptions(args.dir, args.format, args.dump_final_state,
                                            dump_layers=args.dump_layers, layer_convention=args.dump_layer_convention),
                      source=args.source,
                      accept_source_changes=args.accept_source_changes,
                      ray=args.ray, metrics=args.metrics)
    report = run_build(args.build, opts, echo=lambda m: print(m, file=sys.stderr))
    d = report.dump
    bad = [{"path": p.path, "sample_id": p.sample_id, "reason": p.reason, "message": p.message}
           for p in (d.problems if d else [])]
    bad += [{"path": r["path"], "sample_id": r["sample_id"], "reason": r["reason"], "message": r["message"]}
            for r in report.rejected]
    claim = d.claim if d else None
    if _fmt(args) == "json":
        print_json({"run_id": report.run_id, "outcome": report.outcome, "imported": report.written,
                    "scanned": d.scanned if d else 0, "matched": len(d.files) if d else 0, "unusable": bad,
                    "duplicates": [{"path": p.path, "sample_id": p.sample_id, "message": p.message}
                                   for p in (d.duplicates if d else [])],
                    "dump_layers": claim.as_dict() if claim else None})
    else:
        print(f"import {report.run_id[:8]}: {report.outcome}; imported {report.written} sample(s) from "
              f"{d.scanned if d else 0} file(s); {len(bad)} file(s) unusable")
        if claim:
            print(f"dump layers: {claim.describe()}, the build's")
        if d and d.duplicates:  # not unusable: the same tokens and states as the file imported
            print(f"{len(d.duplicates)} duplicate file(s) not imported (the same tokens and states as the file imported): "
                  + ", ".join(p.path for p in d.duplicates))
        if bad:
            print_rows(["path", "sample_id", "reason", "message"],
                       [[b["path"], b["sample_id"] or "", b["reason"], b["message"]] for b in bad],
                       _fmt(args) if _fmt(args) == "csv" else "table", whole=["path", "sample_id"])
            print(f"their samples are left for extraction: hsbuild resume {shlex.quote(args.build)}")
    if report.outcome == "interrupted":
        print("interrupted at a safe point; run the same import again to continue")
        return report.exit_code
    if report.exit_code not in (EXIT_OK, EXIT_SAMPLES_FAILED):
        return report.exit_code
    return EXIT_SAMPLES_FAILED if bad else EXIT_OK


COMMANDS = {"export": cmd_export, "import": cmd_import}
