"""Fixtures of the MoE tests: in-process peers on loopback, shut down after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from swarm.peer import Peer


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
