"""A set of lying DHT nodes, nearer to a key than any honest node, that answer every Find with no
value and with one another as the nearest contacts (live nodes, so they pass every check a reader
makes of an answer). A reader that knows one of them and one honest node looks the key up: along
one path the liars fill its beam and the honest holders are never asked, so the key is hidden;
along disjoint paths (S/Kademlia, `DHTConfig.disjoint_paths`) the path that starts at the honest
node never meets a liar's referral and finds the value."""

from __future__ import annotations

import pytest
from attacks import node_of
from procs import start_peers

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.dht.ids import ID_BITS
from swarm.dht.protocol import FIND
from swarm.dht.routing import DHTID
from swarm.dht.wire import node_id_of
from swarm.proto import dht_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _key_far_from(peer_ids: list[str]) -> str:
    """A key whose DHT ID is at least an eighth of the ID space from every PeerID in `peer_ids`: one
    identity in 8 or more is then nearer, so `_nearer_identities` finds its few in a bounded search. (A key an
    honest node happened to sit right next to left almost no nearer identities: the search gave
    up about once in a few thousand runs.) Each candidate is far enough with probability ~0.77."""
    for i in range(64):
        key = f"hidden-key-{i}"
        key_id = DHTID.from_key(key)
        if all(node_id_of(peer_id) ^ key_id >= 1 << (ID_BITS - 3) for peer_id in peer_ids):
            return key
    raise AssertionError("no key far enough from the honest nodes")


def _nearer_identities(key: str, than: list[str], count: int) -> list[Identity]:
    """`count` identities whose DHT IDs are nearer to `key` than every PeerID in `than`."""
    key_id = DHTID.from_key(key)
    bound = min(node_id_of(peer_id) ^ key_id for peer_id in than)
    found: list[Identity] = []
    for _ in range(20_000):  # each identity is nearer with probability bound / 2^ID_BITS (>= 1/8 here)
        identity = Identity.generate()
        if node_id_of(identity.peer_id) ^ key_id < bound:
            found.append(identity)
            if len(found) == count:
                return found
    raise AssertionError("no identities near enough to the key")


def _refer_only_to(liar, others) -> None:
    """Replaces the Find handler of the in-test peer `liar`: no value, `others` as the nearest."""
    contacts = [dht_pb2.DHTPeer(peer_id=o.peer_id, addr=o.addrs[0].rsplit("/p2p/", 1)[0]) for o in others]

    async def rpc_find(request: dht_pb2.DHTFindRequest, ctx) -> dht_pb2.DHTFindResponse:
        response = dht_pb2.DHTFindResponse(peers=contacts)
        for _ in request.keys:
            response.results.add(type=dht_pb2.DHT_NOT_FOUND, nearest=range(len(contacts)))
        return response

    liar.server.add_unary(FIND, rpc_find, dht_pb2.DHTFindRequest)


@pytest.mark.parametrize(("paths", "found"), [(1, False), (2, True)], ids=["one-path", "two-disjoint-paths"])
def test_lying_nodes_near_a_key_cannot_hide_it_from_disjoint_lookups(make_peer, paths, found) -> None:
    daemons = start_peers(2, "--log-level", "WARNING")
    try:
        addrs = [d.addrs[0] for d in daemons]
        honest_ids = [a.rsplit("/p2p/", 1)[1] for a in addrs]
        key = _key_far_from(honest_ids)
        writer = make_peer(initial_peers=addrs, client_mode=True)
        assert writer.dht.store(key, "genuine", get_dht_time() + 60)
        assert writer.run(writer.dht.node.wait_for_stores(10), timeout=15)  # on both honest nodes
        liars = [make_peer(identity=identity) for identity in _nearer_identities(key, honest_ids, 3)]
        for liar in liars:
            _refer_only_to(liar, [other for other in liars if other is not liar])
        # alpha = 1: one request at a time per path, so the order in which a path meets nodes is
        # fixed; k = 3: three liars fill a beam
        config = DHTConfig(bucket_size=3, num_replicas=3, alpha=1, disjoint_paths=paths, cache_size=0,
                           request_timeout=2.0, lookup_timeout=10.0)
        reader = make_peer(client_mode=True, dht_config=config)
        for known in (liars[0].addrs[0], addrs[-1]):  # one liar, one honest node: its whole routing table
            assert reader.run(reader.dht.node.protocol.call_ping(node_of(known)), timeout=10)
        got = reader.dht.get(key, latest=True)
        if found:
            assert got is not None and got.value == "genuine"
        else:
            assert got is None  # the attack works on a lookup along one path
        assert all(d.proc.poll() is None for d in daemons)
    finally:
        for daemon in daemons:
            daemon.__exit__(None, None, None)
