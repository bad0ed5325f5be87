"""Multiaddr parsing and printing, held against the libp2p project's `multiaddr` package."""

import pytest

from swarm.core.errors import MultiaddrError
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr

PEER = Identity.from_seed(bytes(range(32))).peer_id

GOOD = [
    f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER}",
    "/ip4/127.0.0.1/tcp/0",
    f"/ip6/::1/tcp/8080/p2p/{PEER}",
    "/ip6/2001:db8::1/tcp/1",
    f"/dns4/bootstrap.example.org/tcp/31337/p2p/{PEER}",
    "/dns6/host/tcp/1",
    "/dns/swarm-bootstrap/tcp/31337",
]


@pytest.mark.parametrize("text", GOOD)
def test_round_trip(text):
    addr = Multiaddr.parse(text)
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr


@pytest.mark.parametrize("text", GOOD)
def test_agrees_with_the_libp2p_multiaddr_package(text):
    multiaddr = pytest.importorskip("multiaddr")
    theirs = multiaddr.Multiaddr(text)
    assert str(theirs) == text
    mine = Multiaddr.parse(text)
    assert theirs.value_for_protocol("tcp") == str(mine.port)
    if mine.peer_id:
        assert theirs.value_for_protocol("p2p") == mine.peer_id


def test_parts():
    addr = Multiaddr.parse(f"/ip6/0:0::1/tcp/9/p2p/{PEER}")
    assert (addr.protocol, addr.host, addr.port, addr.peer_id) == ("ip6", "::1", 9, PEER)
    assert addr.grpc_target == "[::1]:9"
    assert Multiaddr.parse("/ip4/0.0.0.0/tcp/1").is_unspecified
    assert str(addr.with_peer_id(None)) == "/ip6/::1/tcp/9"
    assert str(Multiaddr.parse("/ipfs/x".replace("/ipfs/x", f"/ip4/1.2.3.4/tcp/5/ipfs/{PEER}"))).endswith(f"/p2p/{PEER}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("ip4/1.2.3.4/tcp/1", "starts with '/'"),
        ("/ip4/1.2.3.4", "swarm dials"),
        ("/ip4/1.2.3.4/udp/1", "swarm dials"),
        ("/ip4/300.2.3.4/tcp/1", "not a valid /ip4 host"),
        ("/ip6/zz::1/tcp/1", "not a valid /ip6 host"),
        ("/ip4/1.2.3.4/tcp/http", "not a number"),
        ("/ip4/1.2.3.4/tcp/70000", "out of range"),
        ("/ip4/1.2.3.4/tcp/1/p2p/notapeer", "PeerID"),
        (f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/quic", "has no value"),
        (f"/ip4/1.2.3.4/tcp/1/ws/x/p2p/{PEER}", "unsupported part /ws"),
    ],
)
def test_bad_multiaddrs_are_refused_clearly(text, message):
    with pytest.raises(MultiaddrError, match=message):
        Multiaddr.parse(text)
