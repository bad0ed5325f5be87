"""The install tests share one build of swarm's sdist and wheel."""

from __future__ import annotations

from pathlib import Path

import pytest
from install.venvs import build_dists


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("build", reason="the dev extra's `build` makes the sdist and wheel")
    return build_dists(tmp_path_factory.mktemp("dists"))
