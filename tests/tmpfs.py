"""A small tmpfs mounted for one test (a filesystem that fills up), unmounted even when interrupted."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    """Mounts a tmpfs of `size` on `where` (created) for the block; skips the test where it cannot."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          check=False, capture_output=True,
                          text=True, timeout=10)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        # lazily: a file still open (a writer thread) must not keep the mount behind
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=10)
