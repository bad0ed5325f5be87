import sys
from pathlib import Path

import pytest

from swarm.peer import Peer

sys.path.insert(0, str(Path(__file__).parent))  # tests/net/proxy.py


@pytest.fixture
def make_peer():
    peers = []

    def factory(**kwargs):
        peer = Peer(**kwargs)
        peers.append(peer)
        return peer

    yield factory
    for peer in reversed(peers):
        peer.shutdown()
