import pytest

from swarm.peer import Peer


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
