"""`run_sweep` called from Python says nothing unless its caller gives an `echo` (the library never prints; the
CLI passes its printer): a real build, a sweep cut short by an error, and the sweep that continues it."""

from __future__ import annotations

import pytest
from verify_helpers import N_SAMPLES, copy_build, shared_template

from builder.progress import NoProgress
from builder.verify.sweep import SweepOptions, run_sweep


class Broken(Exception):
    pass


class BreaksAfter(NoProgress):
    """A progress object that fails after `n` samples: the sweep ends on an error, unfinished (--continue's case)."""

    def __init__(self, n: int):
        self.left = n

    def update(self, done: int = 0, tokens: int = 0, nbytes: int = 0, note: str = "") -> None:
        self.left -= done
        if self.left <= 0:
            raise Broken


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return shared_template(tmp_path_factory)


def cut_short(build) -> None:
    with pytest.raises(Broken):
        run_sweep(build, SweepOptions(jobs=1, progress=BreaksAfter(3)))


def test_a_sweep_says_nothing_from_python_without_an_echo(template, tmp_path, capfd):
    build = copy_build(template, tmp_path / "b")
    cut_short(build)
    capfd.readouterr()
    s = run_sweep(build, SweepOptions(resume=True))
    assert s.continues and s.outcome == "completed" and s.skipped + s.checked == N_SAMPLES
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")

    cut_short(build)  # what it would have said: given an echo, a continued sweep names the one it continues
    said: list[str] = []
    s = run_sweep(build, SweepOptions(resume=True), echo=said.append)
    assert len(said) == 1 and said[0].startswith(f"continuing sweep {s.continues[:8]} of "), said
    assert capfd.readouterr() == ("", "")
