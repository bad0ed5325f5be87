"""Fixtures for optimizer tests: real peers on loopback (gRPC, DHT, averaging), one thread for torch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from swarm.peer import Peer

sys.path.insert(0, str(Path(__file__).parent))  # optim_task.py, trainer_proc.py


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_peer():
    """Starts peers that join one swarm (each bootstraps from the first); shuts them down at the end."""
    peers: list[Peer] = []

    def factory() -> Peer:
        peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=peers[0].addrs if peers else ())
        peers.append(peer)
        return peer

    yield factory
    for peer in reversed(peers):
        peer.shutdown()
