"""Where a Chromium/Chrome binary is: `lhd doctor` reports it (the report and viewer are checked
in a real headless browser by the test suite, tests/support/browser.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH (or $LHD_CHROMIUM), or None."""
    env = os.environ.get("LHD_CHROMIUM")
    if env:
        return env if Path(env).exists() else shutil.which(env)
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None
