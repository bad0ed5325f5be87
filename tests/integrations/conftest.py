"""Fixtures for the integrations' tests: peers of one swarm on loopback, fast collaboration settings."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swarm.peer import Peer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # gpt2_common.py: the examples' corpus and model
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def swarm_peers() -> Iterator[Callable[[int], list[Peer]]]:
    """`swarm_peers(n)`: n peers of one swarm (each bootstraps from the first), shut down after the test."""
    peers: list[Peer] = []

    def factory(count: int) -> list[Peer]:
        for _ in range(count):
            peers.append(Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=peers[0].addrs if peers else ()))
        return peers[-count:]

    yield factory
    for peer in reversed(peers):
        peer.shutdown()
