"""Open a report page in headless Chromium and read the verdict its inline script writes.

The page's script runs on `load` (after every image has decoded or failed) and writes
"figures ok: N/N" or "figures failed: ids" into `<div id="verdict">`; `--dump-dom` prints the
DOM after that. Chromium comes from Debian (`make test` installs it as root where missing);
without it the test skips, saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


def chromium() -> str:
    exe = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    if exe is None:
        pytest.skip("Chromium is not installed and could not be: `make test` installs Debian's chromium "
                    "with apt-get when run as root")
    return exe


def browser_divs(page: Path, *ids: str) -> dict[str, str]:
    """What the page's script wrote into each `<div id=...>` of `ids` once loaded in headless
    Chromium (one browser start for all of them)."""
    exe = chromium()
    with tempfile.TemporaryDirectory(prefix="dynaresize-chromium-") as profile:
        proc = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", Path(page).resolve().as_uri()],
                              capture_output=True, text=True, timeout=180)
    out = {}
    for div in ids:
        found = re.search(rf'<div id="{div}">([^<]*)</div>', proc.stdout)
        assert found, f"no {div} in Chromium's DOM (exit {proc.returncode}): {proc.stderr[-2000:]}"
        out[div] = found.group(1)
    return out


def browser_verdict(page: Path) -> str:
    """What the page's script wrote into #verdict once loaded in headless Chromium."""
    return browser_divs(page, "verdict")["verdict"]


def assert_every_figure_renders(page: Path, expected: int | None = None) -> int:
    """Every `<img class="plot">` of the page decoded in the browser; returns how many there are."""
    count = Path(page).read_text(encoding="utf-8").count('<img class="plot"')
    if expected is not None:
        assert count == expected
    assert count > 0
    assert browser_verdict(page) == f"figures ok: {count}/{count}"
    return count
