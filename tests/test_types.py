"""swarm/ passes its type check (mypy, pinned in pyproject.toml's dev extra, configured in [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_swarm_type_checks() -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    cache = ROOT / ".mypy_cache"  # git-ignored; makes later runs incremental
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=580,
    )
    assert result.returncode == 0, result.stdout + result.stderr
