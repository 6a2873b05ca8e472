"""A page rendered in a real headless browser (Chromium from the OS packages; .ci/run installs it), for the report
tests (tests/report, tests/run/test_ray.py): the DOM as the browser built it, its log, and a screenshot. Without
Chromium a test skips saying why; HSBUILD_REQUIRE_CHROMIUM=1 (set in .ci/run) makes the skip a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    why = "no Chromium here (apt-get install chromium): the report page is not rendered in a browser"
    if os.environ.get("HSBUILD_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"HSBUILD_REQUIRE_CHROMIUM=1 but: {why}", pytrace=False)
    pytest.skip(why)


def headless(browser: str, page: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--enable-logging=stderr", "--v=0", *flags, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def render(browser: str, page: Path, png: Path) -> tuple[str, str]:
    """(the DOM as the browser built it, the browser's log) after loading `page`, and its screenshot in `png`."""
    shot = headless(browser, page, "--window-size=1280,3000", f"--screenshot={png}")
    assert png.is_file(), shot.stderr[-2000:]
    dom = headless(browser, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout, shot.stderr + dom.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def figure_svg(dom: str, name: str) -> str:
    """The SVG the browser has inside the page's figure `fig-NAME` ('' where it has none)."""
    at = dom.find(f'id="fig-{name}"')
    if at < 0:
        return ""
    end = dom.find("</figure>", at)
    svg = dom.find("<svg", at)
    return dom[svg:end] if 0 <= svg < end else ""
