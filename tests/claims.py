"""Which of the README's crash, power-cut and full-disk claims a test run exercised, and which it skipped (why).

hsbuild claims that nothing committed is lost to a `kill -9`, a power cut or a full disk. The tests of those
claims need things a machine may lack (root for a small real tmpfs, FUSE for the power-cut filesystem), and
skip where it does: a green run may then have proved none of them. So each such test says which claim it is
about, and the run ends with a table of what ran and what was skipped, with the reasons (`pytest_terminal_summary`
in conftest; also written to `$HSBUILD_CLAIMS_REPORT` when set, which .ci/run prints last).

- A test is about a claim by a marker, `@pytest.mark.claim("crash")` (a module: `pytestmark`), or by using what
  the claim needs: the `powercut` fixture says "power cut" and `mounted_tmpfs` (`tmpfs` fixture) "full disk",
  when they are entered, before they can skip.
- `unavailable(kind, reason)` is how such a test skips: a skip naming the reason, or, where
  `$HSBUILD_REQUIRE_<KIND>=1` is set (.ci/run sets them), a failure: a CI run that cannot exercise a claim fails.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

# kind -> (what the summary calls it, the variable that makes a skip a failure)
CLAIMS = {
    "crash": ("crash (kill -9 of real processes)", "HSBUILD_REQUIRE_CRASH"),
    "power-cut": ("power cut and stall (FUSE: shared/powercut)", "HSBUILD_REQUIRE_POWERCUT"),
    "full-disk": ("full disk (a small real tmpfs)", "HSBUILD_REQUIRE_TMPFS"),
}

_current: pytest.Item | None = None  # the test running in this process (set by conftest's autouse fixture)


def set_current(item: pytest.Item | None) -> None:
    global _current
    _current = item
    if item is not None:
        for m in item.iter_markers("claim"):
            touch(m.args[0])


def touch(kind: str) -> None:
    """The running test is about claim `kind` (recorded on its report, so xdist's controller sees it)."""
    if kind not in CLAIMS:
        raise ValueError(f"unknown claim {kind!r} (one of {', '.join(CLAIMS)})")
    if _current is not None and ("claim", kind) not in _current.user_properties:
        _current.user_properties.append(("claim", kind))


def unavailable(kind: str, reason: str) -> None:
    """Skip the running test of claim `kind` with `reason`, or fail it where the claim is required."""
    touch(kind)
    var = CLAIMS[kind][1]
    if os.environ.get(var) == "1":
        pytest.fail(f"{var}=1 but: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Tally:
    ran: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    skipped: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))
    unable: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))  # required, could not run

    def add(self, report: pytest.TestReport) -> None:
        kinds = {v for k, v in getattr(report, "user_properties", ()) if k == "claim"}
        if not kinds:
            return
        for kind in kinds:
            if report.skipped:
                self.skipped[kind][report.nodeid] = _skip_reason(report)
            elif report.failed and report.when == "setup":  # `unavailable` under $HSBUILD_REQUIRE_...=1
                self.unable[kind][report.nodeid] = (str(report.longrepr).strip().splitlines() or ["?"])[-1]
            elif report.when == "call":
                self.ran[kind].add(report.nodeid)

    def lines(self) -> list[str]:
        out = []
        for kind, (name, var) in CLAIMS.items():
            ran, skipped, unable = self.ran[kind], self.skipped[kind], self.unable[kind]
            out.append(f"{name}: {len(ran)} ran, {len(skipped)} skipped"
                       + (f", {len(unable)} could not run (required: {var}=1)" if unable else "")
                       + (f" (set {var}=1 to make a skip fail)" if skipped and os.environ.get(var) != "1" else ""))
            for nodeid, why in sorted(skipped.items()):
                out.append(f"  skipped {nodeid}: {why}")
            for nodeid, why in sorted(unable.items()):
                out.append(f"  could not run {nodeid}: {why}")
        return out


TALLY = Tally()  # this process's: the controller's (or the only process's) is the run's


def _skip_reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)
