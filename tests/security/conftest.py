"""Fixtures of the attack tests: in-process peers (the attacker, the honest client), shut down after
each test; the honest side runs as real `swarm-peer` processes (`tests/procs.py`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm.peer import Peer

sys.path.insert(0, str(Path(__file__).parent))  # attacks.py


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def factory(**kwargs: Any) -> Peer:
        peer = Peer(**kwargs)
        peers.append(peer)
        return peer

    yield factory
    for peer in reversed(peers):
        peer.shutdown()
