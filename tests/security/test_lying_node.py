"""Attack 5: a DHT member answers every Find with 10,000 fake contacts and a forged value that
expires in 1e300 s, or with a 7 MB value. A reader takes at most a bounded number of contacts
from an answer, drops what no honest node would send and bans the liar, so it gets the genuine
value, copies nothing forged onto the honest nodes, opens no channel per fake contact, and
leaves no unretrieved task exception behind."""

from __future__ import annotations

import logging
import os
import socket

import msgpack
import pytest
from procs import start_peers

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.dht.protocol import FIND
from swarm.dht.routing import DHTID, NodeInfo
from swarm.dht.wire import node_id_of
from swarm.proto import dht_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
CLIENT = DHTConfig(request_timeout=2.0, lookup_timeout=10.0, cache_size=0)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lie_on_every_find(liar, value: bytes, expiration_time: float, contacts: int) -> None:
    """Replaces the Find handler of the in-test peer `liar` with one that lies."""
    port = _dead_port()  # fake contacts on loopback only: nothing listens there
    fakes = [dht_pb2.DHTPeer(peer_id=Identity.generate().peer_id, addr=f"/ip4/127.0.0.1/tcp/{port}")
             for _ in range(contacts)]

    async def rpc_find(request: dht_pb2.DHTFindRequest, ctx) -> dht_pb2.DHTFindResponse:
        response = dht_pb2.DHTFindResponse(peers=fakes)
        for _ in request.keys:
            response.results.add(type=dht_pb2.DHT_VALUE, value=value, expiration_time=expiration_time,
                                 nearest=range(len(fakes)))
        return response

    liar.server.add_unary(FIND, rpc_find, dht_pb2.DHTFindRequest)


@pytest.mark.parametrize(
    ("value", "expires_in", "contacts"),
    [(msgpack.packb("forged"), 1e300, 10_000), (os.urandom(7_000_000), 120.0, 0)],
    ids=["far-future-value-and-10000-contacts", "7-MB-value"],
)
def test_a_lying_node_cannot_poison_lookups(make_peer, caplog, value, expires_in, contacts) -> None:
    daemons = start_peers(3, "--log-level", "WARNING")
    try:
        addrs = [d.addrs[0] for d in daemons]
        writer = make_peer(initial_peers=addrs, client_mode=True, dht_config=CLIENT)
        assert writer.dht.store("poisoned", "genuine", get_dht_time() + 60)
        liar = make_peer(initial_peers=addrs)
        lie_on_every_find(liar, value, min(1e300, get_dht_time() + expires_in), contacts)
        reader = make_peer(initial_peers=[liar.addrs[0], *addrs], client_mode=True, dht_config=CLIENT)
        channels = len(reader.pool)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(3):
                found = reader.dht.get("poisoned", latest=True)
                assert found is not None and found.value == "genuine"
        assert reader.dht.node.blacklist.is_banned(liar.peer_id)
        assert len(reader.pool) <= channels + len(daemons) + 1
        assert "never retrieved" not in caplog.text
        key_id = DHTID.from_key("poisoned")
        for daemon in daemons:  # the honest nodes hold the genuine value, no forged copy
            peer_id = daemon.addrs[0].rsplit("/p2p/", 1)[1]
            node = NodeInfo(node_id_of(peer_id), peer_id, daemon.addrs[0])
            answer = writer.run(writer.dht.node.protocol.call_find(node, [key_id]), timeout=10)[key_id]
            if answer.value is not None:
                assert answer.value.value != value
        assert all(d.proc.poll() is None for d in daemons)
    finally:
        for daemon in daemons:
            daemon.__exit__(None, None, None)  # killed, pipes closed
