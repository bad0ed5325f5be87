"""Shared fixtures. `tests/procs.py` starts real peer processes; `make_peer` starts in-process peers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from swarm.peer import Peer


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    """`make_peer(**Peer arguments)` starts a peer on loopback; every one is shut down after the test."""
    peers: list[Peer] = []

    def factory(**kwargs: Any) -> Peer:
        peer = Peer(**kwargs)
        peers.append(peer)
        return peer

    yield factory
    for peer in reversed(peers):
        peer.shutdown()
