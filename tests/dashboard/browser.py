"""Debian's chromium, headless, driven by selenium through Debian's chromedriver (no downloads).

`chrome(tmp_path)` gives a driver or skips the test with the reason (no browser, no selenium).
scripts/system-packages.txt lists the two Debian packages; CI installs them as root.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1600")


def browser_missing() -> str | None:
    """Why no browser test can run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            return f"{path} is missing (apt-get install chromium chromium-driver; scripts/system-packages.txt)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    return None


@contextmanager
def chrome(tmp_path: Path) -> Iterator[Any]:
    """A headless chromium with a fresh profile under `tmp_path`, quit afterwards."""
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
