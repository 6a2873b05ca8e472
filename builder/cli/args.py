"""Argument types and the output flags every command shares (`--json`, `--csv`, else a table)."""

from __future__ import annotations

import argparse
import difflib
import functools
import re


class Parser(argparse.ArgumentParser):
    """argparse with hsbuild's one-line errors: `hsbuild CMD: error: ...` first, exit code 2 (no usage dump).

    A subcommand's parser refuses the flags it does not know itself, so the error names `hsbuild CMD` and its
    --help (plain argparse hands them up to the top-level parser, which names `hsbuild`)."""

    def __init__(self, *args, subcommand: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.subcommand = subcommand

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", functools.partial(type(self), subcommand=True))
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self.subcommand:
            self.error(self._unrecognized(extras))
        return ns, extras

    def _unrecognized(self, extras: list[str]) -> str:
        msg = f"unrecognized arguments: {' '.join(extras)}"
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for flag in (e.split("=", 1)[0] for e in extras if e.startswith("--")):
            close = difflib.get_close_matches(flag, known, n=1)
            if close:
                return f"{msg}; did you mean {close[0]}?"
        return msg

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def fmt_of(args: argparse.Namespace) -> str:
    return "json" if getattr(args, "json", False) else "csv" if getattr(args, "csv", False) else "table"


def out_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="machine-readable JSON")
    g.add_argument("--csv", action="store_true", help="CSV")
    return p


def int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}': give comma-separated integers, e.g. 2,16,29") from None


def size(s: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = s.strip().lower().rstrip("ib").rstrip("b") if s.strip().lower() not in ("0",) else "0"
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        n = float(num) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}': give a size like 500M or 2G") from None
    if not 0 <= n < 1 << 62:
        raise argparse.ArgumentTypeError(f"'{s}': give a size of 0 or more, like 500M or 2G")
    return int(n)


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}': give a whole number") from None


def _at_least(s: str, low: int) -> int:
    n = _int(s)
    if n < low:
        raise argparse.ArgumentTypeError(f"'{s}': must be {low} or more")
    return n


def positive_int(s: str) -> int:
    return _at_least(s, 1)


def workers(s: str) -> int | str:
    """`auto` (sized from the host at the run's start) or a count of 1 or more."""
    if s == "auto":
        return s
    try:
        return positive_int(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"'{s}': use auto or a number of 1 or more") from None


def count(s: str) -> int:
    return _at_least(s, 0)


def fraction(s: str) -> float:
    """A usage fraction in (0, 1] (watermarks)."""
    try:
        f = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}': give a fraction of the volume, e.g. 0.9") from None
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"'{s}': must be a fraction of the volume in (0, 1], e.g. 0.9")
    return f


def device(s: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (syntax only; whether CUDA is there is the library's question)."""
    if s == "auto" or re.fullmatch(r"(cpu|cuda)(:[0-9]+)?", s):
        return s
    raise argparse.ArgumentTypeError(f"'{s}': use auto, cpu, cuda or cuda:N")


def metrics_address(s: str) -> str:
    from builder.log.metrics import MetricsAddressError, parse_address  # noqa: PLC0415

    try:
        return str(parse_address(s))
    except MetricsAddressError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--metrics {s!r}: ")) from e


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=workers, metavar="N|auto",
                   help="extraction worker processes, the CPUs split among them (default: config; a new build's is "
                        "auto: one a visible GPU, else one a CPU core as far as half the free memory holds copies "
                        "of the model, at most 8; one with an inference server)")
    p.add_argument("--limit", type=count, help="process at most N samples in this run")
    p.add_argument("--max-attempts", type=positive_int,
                   help="failed samples are retried until this many attempts (3)")
    p.add_argument("--device", type=device, help="auto, cpu or cuda[:N] (default: config, auto)")
    p.add_argument("--verify-after-write", action="store_true", default=None,
                   help="read each sample back right after writing and record `verified`")
    p.add_argument("--allow-overcommit", action="store_true",
                   help="start even if the projected size does not fit below the high watermark (writers pause)")
    p.add_argument("--force", action="store_true", help="start despite blocking preflight problems")
    p.add_argument("--low", type=fraction, help="resume writing below this usage fraction (0.85)")
    p.add_argument("--high", type=fraction, help="pause writers at this usage fraction (0.90)")
    p.add_argument("--flood", type=fraction, help="never start a write that would cross this usage fraction (0.95)")
    p.add_argument("--min-free", type=size, help="pause when free space drops below this, e.g. 50G")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--take-over", action="store_true",
                   help="take the build over from an owner on another host that never released it (make sure it "
                        "no longer runs there first)")
    p.add_argument("--launch", action="store_true",
                   help="engine backends: start the server (`hsbuild serve-command BUILD`) as a child, restart it "
                        "if it dies, stop it at the end; without it hsbuild waits for a server you run")
    p.add_argument("--trust-server", action="store_true",
                   help="engine backends: accept a server whose configuration (model, layer ids) cannot be read "
                        "from its process (another host or namespace), judging it by its answers alone; recorded in "
                        "the run's events and shown by status")
    p.add_argument("--inflight", type=positive_int, help="engine backends: requests in flight (default: config, 16)")
    p.add_argument("--batch-tokens", type=count, metavar="N",
                   help="in-process backend: pack samples into forward passes of up to N tokens, and a "
                        "regenerating build decodes its generations together, 0: one sample a pass (default: config, "
                        "0); the tokens and states are the same, bit for bit")
    p.add_argument("--ray", metavar="auto|HOST:PORT",
                   help="workers as actors on this Ray cluster (`pip install 'hsbuild[ray]'`; docs/ray.md): every "
                        "node writes into the shared build directory; the log stays on this node")
    p.add_argument("--metrics", type=metrics_address, metavar="HOST:PORT",
                   help="serve Prometheus metrics (samples and tokens by state, throughput, disk and watermarks, "
                        "pauses and stalls, engine health, per node on Ray) at http://HOST:PORT/metrics while the "
                        "run lasts; port 0: any free one, printed at the start (docs/runbook.md has a scrape config)")
    p.add_argument("--source", metavar="NEWPATH",
                   help="the build's source moved here: accepted when it holds the registered samples (recorded in "
                        "the log; hsbuild.toml updated)")
    p.add_argument("--accept-source-changes", action="store_true",
                   help="the source was edited: record changed rows (extracted again), removed rows (retired) and "
                        "new rows instead of refusing")


class BackendNames:
    """`--backend`'s choices: the registered backends (builder/extract/backends/registry.py), read only when
    `init` is parsed or its help is shown, not at every command's start."""

    def __contains__(self, name: object) -> bool:  # (a plug-in that fails to load: init says why)
        from builder.extract.backends.registry import declared  # noqa: PLC0415

        return isinstance(name, str) and declared(name)

    def __iter__(self):
        return iter(self._names())

    @staticmethod
    def _names() -> list[str]:
        from builder.extract.backends.registry import names  # noqa: PLC0415

        return names()


class RegistryHelp(str):
    """A help text naming the registered backends, filled in only when the help is shown (argparse formats each
    help with `%` then): `{described}` each build backend and what runs its forward passes, `{servers}` the
    backends whose model an inference server runs (`--backend NAME or ...`)."""

    __slots__ = ()

    def __mod__(self, params: object) -> str:
        from builder.extract.backends import registry  # noqa: PLC0415

        servers = " or ".join(f"--backend {n}" for n in registry.with_server())
        return str.__mod__(str(self).replace("{described}", registry.described()).replace("{servers}", servers),
                           params)


def add_regen_flags(p: argparse.ArgumentParser) -> None:
    """`init --regenerate` and its generation settings (docs/regenerate.md; checked by the library, which names
    the flag of a bad value)."""
    g = p.add_argument_group("regeneration (docs/regenerate.md)")
    g.add_argument("--regenerate", action="store_true",
                   help="generate the source's assistant turns with the model and store them with their states, in "
                        "one pass (the source's rows are conversations)")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens a generated turn holds at most (2048)")
    g.add_argument("--temperature", type=float, metavar="T", help="sampling temperature; 0, the default: greedy")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling: keep the smallest set of tokens "
                   "holding P of the probability (1.0)")
    g.add_argument("--seed", type=int, metavar="S", help="the build's seed; each sample's is mixed from it and the "
                   "sample id (0)")
    g.add_argument("--turns", metavar="all|last", help="all (the default): every assistant turn, in order, each "
                   "after the regenerated ones before it; last: only the final one")
    g.add_argument("--drop-truncated", action="store_true",
                   help="retire responses that stopped at the token limit (finish_reason length); by default they "
                        "are kept and counted")
