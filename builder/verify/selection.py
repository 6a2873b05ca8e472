"""What a verify sweep covers: its options (`hsbuild verify`'s flags, each checked with a one-line refusal) and the
`Selection` of samples they make, which `verify_started` records so that `--continue` selects the same ones."""

from __future__ import annotations

import datetime as dt
import hashlib
import random
from dataclasses import dataclass

from builder.errors import UsageError
from builder.progress import Progress
from builder.subset import parse_subset, stable_part


@dataclass
class SweepOptions:
    quick: bool = False
    subset: str | None = None  # "n/t": the n-th of t fixed parts (1-based)
    fraction: float | str | None = None  # a random fraction of the samples, 0 < F <= 1
    seed: int | str | None = None  # for --fraction; recorded so --continue picks the same samples
    not_verified_since: str | dt.datetime | None = None  # ISO timestamp; naive means UTC
    segments: list[str] | None = None
    max_rate: float | str | None = None  # MB/s (10^6 bytes) of chunk-file bytes read
    jobs: int | str | None = None
    resume: bool = False  # --continue
    progress: Progress | None = None  # where progress is reported (the CLI draws a bar); None: nowhere
    take_over: bool = False  # take the lock over from an owner on another host (--take-over)


def parse_fraction(s: float | str) -> float:
    try:
        f = float(s)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise UsageError(f"--fraction '{s}': give a number in (0, 1], e.g. 0.05")
    return f


def parse_time(s: str | dt.datetime) -> dt.datetime:
    """An ISO timestamp as naive UTC (the log's convention). Naive input is taken as UTC."""
    if isinstance(s, dt.datetime):
        t = s
    else:
        try:
            t = dt.datetime.fromisoformat(str(s).strip())
        except ValueError:
            raise UsageError(f"--not-verified-since '{s}': give an ISO timestamp in UTC, "
                             "e.g. 2025-05-01T12:00:00Z") from None
    if t.tzinfo is not None:
        t = t.astimezone(dt.UTC).replace(tzinfo=None)
    return t


def parse_rate(s: float | str) -> float:
    try:
        r = float(s)
    except ValueError:
        r = -1.0
    if not r > 0:
        raise UsageError(f"--max-rate '{s}': give MB/s as a positive number, e.g. 200")
    return r


MAX_DEFAULT_JOBS = 4  # readers a sweep starts without --jobs, at most
PARALLEL_FROM_BYTES = 32 << 10  # mean compressed bytes a sample from which a full sweep reads in parallel


def default_jobs(quick: bool, mean_sample_bytes: float, cpus: int) -> int:
    """The readers a sweep starts without `--jobs`. A reader holds the GIL for its bookkeeping (about 100 us a
    sample, whatever its size) and lets go of it only to read, decompress and checksum, which grow with the
    sample's bytes: a third of a unit's time for samples of 9 kB compressed (8-32 tokens, hidden 64), three
    quarters at 100 kB, over nine tenths from 400 kB. Below PARALLEL_FROM_BYTES a sample (the mean `written`
    nbytes of the samples the sweep selected) readers mostly wait for each other's GIL, and one reads faster
    than two, on any number of cores (docs/verify.md, "Throughput"). Otherwise, and in a quick sweep (it reads
    no chunk data: it waits on file metadata, which readers overlap), a reader a CPU, at most MAX_DEFAULT_JOBS."""
    most = max(1, min(MAX_DEFAULT_JOBS, cpus))
    if not quick and mean_sample_bytes < PARALLEL_FROM_BYTES:
        return 1
    return most


def parse_jobs(s: int | str | None) -> int | None:
    """`--jobs`: a number of readers, or None (not given: `default_jobs` decides once the samples are known)."""
    if s is None:
        return None
    try:
        j = int(s)
    except ValueError:
        j = 0
    if not 1 <= j <= 256:
        raise UsageError(f"--jobs '{s}': give a number of parallel readers from 1 to 256")
    return j


def parse_seed(s: int | str) -> int:
    try:
        return int(s)
    except ValueError:
        raise UsageError(f"--seed '{s}': give an integer") from None


def _draw(sample_id: str, seed: int) -> float:
    h = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


@dataclass
class Selection:
    """Which samples a sweep covers. Stored in `verify_started` so `--continue` selects the same ones."""

    mode: str = "full"  # full | quick
    subset: str | None = None
    fraction: float | None = None
    seed: int | None = None
    not_verified_since: str | None = None  # ISO, naive UTC
    segments: list[str] | None = None

    @classmethod
    def from_options(cls, o: SweepOptions) -> Selection:
        sel = cls(mode="quick" if o.quick else "full")
        if o.subset is not None:
            n, t = parse_subset(o.subset)
            sel.subset = f"{n}/{t}"
        if o.fraction is not None:
            sel.fraction = parse_fraction(o.fraction)
            sel.seed = parse_seed(o.seed) if o.seed is not None else random.SystemRandom().randrange(1 << 31)
        elif o.seed is not None:
            raise UsageError("--seed: only meaningful with --fraction")
        if o.not_verified_since is not None:
            sel.not_verified_since = parse_time(o.not_verified_since).isoformat()
        if o.segments:
            sel.segments = sorted(set(o.segments))
        return sel

    @classmethod
    def from_detail(cls, d: dict) -> Selection:
        return cls(**{k: d.get(k) for k in ("mode", "subset", "fraction", "seed", "not_verified_since", "segments")})

    def matches(self, sample_id: str, segment: str, verified_at: dt.datetime | None) -> bool:
        if self.segments and segment not in self.segments:
            return False
        if not self.matches_id(sample_id):
            return False
        if self.not_verified_since is not None and verified_at is not None:
            if verified_at >= dt.datetime.fromisoformat(self.not_verified_since):
                return False
        return True

    def matches_id(self, sample_id: str) -> bool:
        """The part of `matches` that depends on the sample id alone: --subset and --fraction."""
        if self.subset:
            n, t = parse_subset(self.subset)
            if stable_part(sample_id, t) != n - 1:
                return False
        return self.fraction is None or _draw(sample_id, int(self.seed or 0)) < self.fraction

    def describe(self) -> str:
        parts = [self.mode]
        if self.subset:
            parts.append(f"subset {self.subset}")
        if self.fraction is not None:
            parts.append(f"fraction {self.fraction:g} (seed {self.seed})")
        if self.not_verified_since:
            parts.append(f"not verified since {self.not_verified_since}Z")
        if self.segments:
            parts.append("segment " + ", ".join(self.segments))
        return ", ".join(parts)
