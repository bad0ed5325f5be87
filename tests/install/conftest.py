"""The install tests share one build of swarm's sdist and wheel, also across xdist workers."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from install.venvs import build_dists


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("build", reason="the dev extra's `build` makes the sdist and wheel")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above each worker's own
    out = base / "swarm-dists"
    with open(base / "swarm-dists.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker builds; one that comes later reuses it
        if (out / "built").is_file():  # build_dists left one of each in out/dist
            return next((out / "dist").glob("*.tar.gz")), next((out / "dist").glob("*.whl"))
        out.mkdir(exist_ok=True)
        dists = build_dists(out)
        (out / "built").touch()
        return dists
