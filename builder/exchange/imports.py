"""`hsbuild import BUILD DIR --format F`: which dump file holds which sample of the build's source.

Files are matched to samples by their token ids, not by their names: SpecForge numbers its files in a shuffled
order, a home-grown script by whatever it liked, and a file whose tokens are not a source row's is no sample of
this build whatever its name says. A file's ids must equal the sample's ids as the build stores them (the
source row, cut to --max-tokens); a SpecForge file may carry trailing (token 0, mask 0) batch padding, which is
tried off. Samples with equal tokens share a file (their states are the same). Files whose tokens cannot be
read, or match no sample, are listed with the reason; they are never modified. Several files holding the same
tokens are compared by their states (`settle`, loaded and hashed only for such samples): identical, the first is
imported and the others listed `duplicate` (harmless); different, none is imported, each is listed `conflict`
naming the others, and the sample is left for extraction (which of them is right cannot be told).

Which layers a dump holds cannot be read off its tensors: a dump of layers [1, 3, 6] is as wide as one of the
build's [2, 4, 5]. So an import needs a claim (`check_dump`), taken from the dump's own metadata where it has any
(an hsbuild export's journal, `hsbuild-export.json`, lists its layers in every numbering) or else from
`--dump-layers` in `--dump-layer-convention` (default: the format's own numbering); with neither it is refused.
The claim is compared with the build's aux layers in the same numbering, and the first matched files' widths
with the build's (`index_dump`), before anything is written: a dump that contradicts the build is refused as a
whole (`DumpRefused`, exit 4), never imported as the build's layers.

The run itself is an ordinary run (`run.coordinator`) with the import backend (`extract.backends.dump`): each
matched file is checked in full by a worker before its states are written, with checksums, in durable groups,
its `written` event naming the file (`detail.import`). Samples without a usable file stay for `resume`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from builder.errors import EXIT_PREFLIGHT, FormatError, HsbuildError, UsageError
from builder.extract.source import Sample
from builder.formats import registry
from builder.formats.base import Rejected, TrainerFormat
from builder.formats.final_state import FINAL_STATES
from builder.formats.numbering import CONVENTIONS, NUMBERINGS, layer_numberings
from builder.layout import BuildLayout

JOURNAL = "hsbuild-export.json"  # an hsbuild export's journal (builder/exchange/export.py): its layers, every numbering
WIDTH_PROBES = 3  # matched files read to judge the dump's width (one odd file among them is that file's problem)


class DumpRefused(HsbuildError, ValueError):
    """The dump is not this build's: it holds other layers, or states of another width. Nothing is imported."""

    exit_code = EXIT_PREFLIGHT


@dataclass
class ImportOptions:
    dir: str
    format: str
    final_state: str = "post_norm"  # `pt` files that do not say: is their final state after the norm or before
    jobs: int = 8  # threads reading token ids while matching
    dump_layers: list[int] | None = None  # the aux layers the dump holds (final state excluded), in:
    layer_convention: str | None = None  # a key of BuildInfo.layer_ids() or its short name; None: the format's


@dataclass(frozen=True)
class BuildGeometry:
    """What a dump must match: the build's hidden size and aux layers (Hugging Face hidden_states indices) of a
    model of `num_layers` layers, as `init` recorded them in data/zarr.json."""

    hidden_size: int
    num_layers: int
    aux_layers: tuple[int, ...]
    final_state: str = "post_norm"  # what the build stores (a build that recorded none: post_norm)

    @classmethod
    def load(cls, lay: BuildLayout) -> BuildGeometry:
        from builder.extract.build_meta import recorded_meta  # noqa: PLC0415 - (the model's config: imports only)

        meta = recorded_meta(lay)
        return cls(int(meta["hidden_size"]), int(meta["num_layers"]), tuple(int(i) for i in meta["aux_layers"]),
                   str(meta.get("final_state") or "post_norm"))

    @property
    def n_aux(self) -> int:
        return len(self.aux_layers)

    def layer_ids(self) -> dict[str, list[int]]:
        """The aux layers, then the final state, in each numbering (the one rule `BuildInfo.layer_ids()` uses)."""
        return layer_numberings(self.aux_layers, self.num_layers)


@dataclass(frozen=True)
class LayerClaim:
    """Which aux layers a dump holds, in which numbering, and who says so."""

    layers: tuple[int, ...]
    convention: str  # a key of BuildInfo.layer_ids()
    source: str  # "dump": its own metadata says so (`metadata`); "flag": --dump-layers
    metadata: str | None = None
    build: BuildGeometry | None = field(default=None, compare=False, repr=False)  # what it was checked against

    def as_dict(self) -> dict:
        return {"layers": list(self.layers), "convention": self.convention, "source": self.source,
                **({"metadata": self.metadata} if self.metadata else {})}

    def describe(self) -> str:
        return (f"{_ids(self.layers)} ({self.convention} ids, from "
                + (f"{self.metadata})" if self.source == "dump" else "--dump-layers)"))


@dataclass(frozen=True)
class FileProblem:
    path: str
    # truncated, unreadable, bad_keys, bad_shape, token_mismatch; conflict (problems: the same tokens as another
    # file, other states); duplicate (DumpIndex.duplicates: the same tokens and states as the file imported)
    reason: str
    message: str
    sample_id: str | None = None  # the sample its tokens match, else the one its file's name points at


@dataclass
class DumpIndex:
    files: dict[str, str] = field(default_factory=dict)  # sample id -> dump file
    problems: list[FileProblem] = field(default_factory=list)  # unusable files: their samples are not imported
    duplicates: list[FileProblem] = field(default_factory=list)  # copies of a file imported: harmless, not imported
    scanned: int = 0
    claim: LayerClaim | None = None  # the layers the dump holds, checked against the build's

    def summary(self) -> dict:
        return {"scanned": self.scanned, "matched_samples": len(self.files), "problems": len(self.problems),
                **({"duplicates": len(self.duplicates)} if self.duplicates else {}),
                **({"dump_layers": self.claim.as_dict()} if self.claim is not None else {})}


def check_options(opts: ImportOptions) -> Path:
    registry.get(opts.format, imports=True)  # FormatError (a UsageError) naming the formats that import
    if opts.final_state not in FINAL_STATES:
        raise UsageError(f"--final-state {opts.final_state}: use one of {', '.join(FINAL_STATES)}")
    root = Path(opts.dir).absolute()
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory; give the folder of the dump to import")
    return root


def convention_of(opts: ImportOptions) -> str:
    """The numbering --dump-layers is in: the flag's (a short name allowed), else the format's own."""
    name = opts.layer_convention or registry.get(opts.format).layer_convention
    full = CONVENTIONS.get(name, name)
    if full not in NUMBERINGS:
        raise UsageError(f"--dump-layer-convention {name}: use one of "
                         + ", ".join(f"{v} ({k})" for k, v in CONVENTIONS.items()))
    return full


def check_dump(opts: ImportOptions, lay: BuildLayout) -> LayerClaim:
    """The layers the dump holds, checked against the build's aux layers in the same numbering, before anything
    is read from the dump's files or written to the build. Raises UsageError (no claim; --dump-layers malformed
    or contradicting the dump's own metadata) or DumpRefused (the dump holds other layers than the build)."""
    root = check_options(opts)
    conv = convention_of(opts)
    info = BuildGeometry.load(lay)
    if registry.get(opts.format).dump_final_state == "post_norm" and info.final_state == "pre_norm":
        raise UsageError(f"{root}: {opts.format} dumps hold the final state after the model's norm, which cannot "
                         f"be undone, and {lay.root} stores it before the norm (final_state = pre_norm, the default "
                         f"of new builds); make the build for this dump with `hsbuild init ... --final-state "
                         "post_norm`")
    build_ids = info.layer_ids()[conv]
    build_aux, build_final = [int(i) for i in build_ids[:-1]], int(build_ids[-1])
    given = None if opts.dump_layers is None else _check_given(opts.dump_layers, conv)
    meta = dump_metadata(root, conv)
    if meta is not None:
        path, aux, final = meta
        claim = LayerClaim(tuple(aux), conv, "dump", str(path), info)
        if aux != build_aux:
            raise DumpRefused(_other_layers(root, claim, build_aux, info))
        if final is not None and final != build_final:
            raise DumpRefused(f"{root}: {path} says its model's final state is layer {final} ({conv} ids), the "
                              f"build's is {build_final}: a model of another depth, not this build's; nothing "
                              "imported")
        if given is not None and given != aux:
            raise UsageError(f"--dump-layers {_ids(given)} ({conv} ids): contradicts {path}, which says the dump "
                             f"holds {_ids(aux)}; leave --dump-layers out (the dump says which layers it holds)")
        return claim
    if given is None:
        flag = "--dump-layers" + ("=" if min(build_aux) < 0 else " ")  # argparse reads a bare -1,0,1 as a flag
        raise UsageError(f"{root}: the dump does not say which layers it holds; give them: {flag}"
                         f"{_ids(build_aux)} if it holds the build's aux layers ({conv} ids"
                         + ("" if opts.layer_convention else f", {opts.format}'s numbering")
                         + "; --dump-layer-convention for another)")
    claim = LayerClaim(tuple(given), conv, "flag", None, info)
    if given != build_aux:
        raise DumpRefused(_other_layers(root, claim, build_aux, info))
    return claim


def _ids(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


def _check_given(ids: list[int], conv: str) -> list[int]:
    ids = [int(i) for i in ids]
    low = -1 if conv == CONVENTIONS["decoder"] else 0  # decoder layer -1: the embeddings (hidden_states[0])
    if not ids:
        raise UsageError("--dump-layers: give the aux layer ids the dump holds, e.g. 1,2,3 (the final state not "
                         "among them)")
    bad = [i for i in ids if i < low]
    if bad:
        raise UsageError(f"--dump-layers {_ids(ids)}: {bad[0]} is no {conv} layer id (the smallest is {low})")
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise UsageError(f"--dump-layers {_ids(ids)}: {dups[0]} appears more than once")
    return ids


def _to_hf(ids, conv: str) -> list[int]:
    return [int(i) + 1 for i in ids] if conv == CONVENTIONS["decoder"] else [int(i) for i in ids]


def _other_layers(root: Path, claim: LayerClaim, build_aux: list[int], info: BuildGeometry) -> str:
    hf = _to_hf(claim.layers, claim.convention)
    hint = (f"; its states belong in a build of those layers (`hsbuild init ... --aux-layers {_ids(hf)}`)"
            if all(0 <= i <= info.num_layers for i in hf) else "")
    return (f"{root}: the dump holds aux layers {claim.describe()}, the build {_ids(build_aux)} "
            f"({claim.convention} ids): not this build's layers, nothing imported{hint}")


def dump_metadata(root: Path, conv: str) -> tuple[Path, list[int], int | None] | None:
    """What the dump itself says it holds: (the file, its aux layers in `conv`, its final state's id in `conv`
    where known), or None when it says nothing. An hsbuild export's journal lists its layers in every numbering
    (`layer_ids`); it sits at the export's top, also above speculators' `hidden_states/` and SpecForge's
    `rows_*` folders. (SpecForge, speculators and Model-Optimizer dumps keep no such record: their layer ids
    live in the draft config or the server's command line.)"""
    dirs = [root]
    if root.name == "hidden_states" or re.fullmatch(r"rows_\d+-\d+", root.name):
        dirs.append(root.parent)
    for d in dirs:
        path = d / JOURNAL
        if not path.is_file():
            continue
        try:
            j = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: unreadable ({type(e).__name__}: {e}); it should say which layers the dump "
                             "holds: restore it, or move it away and give --dump-layers") from None
        ids = (j.get("layer_ids") or {}).get(conv) if isinstance(j, dict) else None
        if _int_list(ids) and len(ids) >= 2:
            return path, [int(i) for i in ids[:-1]], int(ids[-1])
        hf = (j.get("build") or {}).get("aux_layers") if isinstance(j, dict) else None
        if _int_list(hf) and hf:
            return path, [i - 1 for i in hf] if conv == CONVENTIONS["decoder"] else list(hf), None
        raise UsageError(f"{path}: names no layer ids; it should say which layers the dump holds: restore it, or "
                         "move it away and give --dump-layers")
    return None


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _key(ids: np.ndarray) -> tuple[int, bytes]:
    a = np.ascontiguousarray(ids, dtype=np.int64)
    return int(a.shape[0]), hashlib.blake2b(a.tobytes(), digest_size=16).digest()


def index_dump(opts: ImportOptions, samples: Iterable[Sample], max_tokens: int | None,
               claim: LayerClaim | None = None) -> DumpIndex:
    """Read every file's token ids (in threads) and match them to the source's samples; with the checked `claim`
    (`check_dump`), refuse the dump (DumpRefused) unless its first matched files are as wide as the build's."""
    root = check_options(opts)
    fmt = registry.make_format(opts.format, imports=True, final_state=opts.final_state)
    paths = fmt.scan(root)
    if not paths:
        raise FormatError(f"{root}: no {opts.format} files found (see `hsbuild import --help` for what each format's "
                          "files are called)")
    by_key: dict[tuple[int, bytes], list[str]] = {}
    by_row: dict[int, str] = {}
    ids_of: set[str] = set()
    for s in samples:
        ids = s.input_ids[:max_tokens] if max_tokens else s.input_ids
        by_key.setdefault(_key(ids), []).append(s.sample_id)
        by_row[s.row] = s.sample_id
        ids_of.add(s.sample_id)
    n_tokens = {sids[0]: n for (n, _), sids in by_key.items()}

    def read(p: Path):
        try:
            return fmt.tokens(p)
        except Rejected as e:
            return e
        except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's problem
            return Rejected("unreadable", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    out = DumpIndex(scanned=len(paths), claim=claim)
    holders: dict[tuple[str, ...], list[str]] = {}  # the samples of one token sequence -> the files holding it
    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        for p, got in zip(paths, pool.map(read, paths), strict=True):
            if isinstance(got, Rejected):
                out.problems.append(FileProblem(str(p), got.reason, str(got), _hint(fmt, p, by_row, ids_of)))
                continue
            ids, mask = got
            matched = _match(ids.numpy(), None if mask is None else mask.numpy(), by_key)
            if not matched:
                out.problems.append(FileProblem(str(p), "token_mismatch",
                                                f"its {ids.shape[0]} token ids are no source row of the build",
                                                _hint(fmt, p, by_row, ids_of)))
                continue
            holders.setdefault(tuple(matched), []).append(str(p))
        for sids, files in holders.items():
            chosen = files[0] if len(files) == 1 else settle(fmt, sids, files, n_tokens[sids[0]], out, pool)
            if chosen is not None:
                for sid in sids:
                    out.files[sid] = chosen
    if claim is not None and claim.build is not None:
        check_width(fmt, root, out, claim)
    return out


def settle(fmt: TrainerFormat, sids: tuple[str, ...], files: list[str], n: int, out: DumpIndex,
           pool=None) -> str | None:
    """Several files hold the tokens of `sids` (n tokens as stored): which one to import, if any. Each is loaded
    and its states hashed (`states_digest`; only for such samples: a clean dump pays nothing). All the same bit
    for bit: the first is imported, the others are `duplicate` (out.duplicates, harmless). Any two different:
    none is imported, each is a `conflict` naming the others (out.problems), and the sample is left for
    extraction. A file that does not load is that file's problem and takes no part in the comparison."""
    def digest(path: str):
        try:
            return states_digest(fmt.load(Path(path)), n)
        except Rejected as e:
            return e
        except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's problem
            return Rejected("unreadable", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    sid = sids[0]
    got = dict(zip(files, (pool.map if pool is not None else map)(digest, files), strict=True))
    ok = [p for p in files if not isinstance(got[p], Rejected)]
    for p in files:
        if isinstance(got[p], Rejected):
            out.problems.append(FileProblem(p, got[p].reason, str(got[p]), sid))
    if not ok:
        return None
    if len({got[p] for p in ok}) == 1:
        for p in ok[1:]:
            out.duplicates.append(FileProblem(p, "duplicate", f"the same tokens and states as {ok[0]}, which is "
                                                              "imported: this one is not", sid))
        return ok[0]
    for p in ok:
        others = [q for q in ok if q != p]
        out.problems.append(FileProblem(p, "conflict", f"the same {n} tokens as {', '.join(others)} but other "
                                                       "states: none of them is imported (which is right cannot be "
                                                       "told); the sample is left for extraction", sid))
    return None


def states_digest(got, n: int) -> bytes:
    """A hash of a loaded file's states (aux, final) as the sample's n tokens hold them (SpecForge's batch padding
    past n left out), with their dtype, shape and final-state convention: equal only when the states are the
    same bit for bit."""
    import torch  # noqa: PLC0415 - (fmt.load gave torch tensors: it is loaded)

    h = hashlib.blake2b(digest_size=16)
    h.update(str(got.final_state).encode())
    for t in (got.aux, got.final):
        if t.dim() >= 1 and t.shape[0] > n:
            t = t[:n]
        t = t.contiguous()
        h.update(f"|{t.dtype}{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def check_width(fmt: TrainerFormat, root: Path, index: DumpIndex, claim: LayerClaim) -> None:
    """The dump's width from its first matched files (at most WIDTH_PROBES read): unless one of them holds aux
    states n_aux*H wide and a final state H wide, the dump is refused as a whole. A file that does not load, or
    one odd file beside a good one, is left to the workers' per-file checks (`bad_shape`, ...)."""
    info = claim.build
    h, k = info.hidden_size, info.n_aux
    seen: list[tuple[str, int, int]] = []
    for path in sorted(set(index.files.values()))[:WIDTH_PROBES]:
        try:
            got = fmt.load(Path(path))
        except Exception:  # noqa: BLE001, S112 - that file's own problem: its worker reports it
            continue
        if got.aux.dim() != 2 or got.final.dim() != 2:
            continue
        a, f = int(got.aux.shape[1]), int(got.final.shape[1])
        if (a, f) == (k * h, h):
            return
        seen.append((path, a, f))
    if not seen:
        return
    path, a, f = seen[0]
    why = (f"hidden size {f}: another model" if f != h else
           f"{a // h} aux layers, the claim {claim.describe()} names {len(claim.layers)}" if a % h == 0 else
           "not a whole number of layers")
    more = f" and {len(seen) - 1} more file(s)" if len(seen) > 1 else ""
    raise DumpRefused(f"{root}: its states are {a} (aux) and {f} (final) wide ({path}{more}); the build holds "
                      f"{k} aux layers of hidden size {h}: {k * h} and {h} ({why}); not this build's states, "
                      "nothing imported")


def _match(ids: np.ndarray, mask: np.ndarray | None, by_key: dict) -> list[str]:
    hit = by_key.get(_key(ids))
    if hit:
        return hit
    # SpecForge right-pads a file to its batch's longest row with token 0 and mask 0: try the tail off
    nz = np.flatnonzero(ids != 0) if mask is None else np.flatnonzero((ids != 0) | (mask != 0))
    last = int(nz[-1]) + 1 if nz.size else 0
    for n in range(ids.shape[0] - 1, max(last, 1) - 1, -1):
        hit = by_key.get(_key(ids[:n]))
        if hit:
            return hit
    return []


def _hint(fmt: TrainerFormat, path: Path, by_row: dict[int, str], ids: set[str]) -> str | None:
    """The sample a file's name points at, where its format names files by sample (for the report only)."""
    named = fmt.named_sample(path)
    if isinstance(named, int):
        return by_row.get(named)
    return named if named in ids else None
