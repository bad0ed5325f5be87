"""Fixtures for DHT tests with real peers (helpers live in localswarm.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from localswarm import Swarm


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    network = Swarm()
    yield network
    network.close()
