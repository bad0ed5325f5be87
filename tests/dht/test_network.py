"""A 50-node DHT in one process (real gRPC servers on port 0, one shared event-loop thread) plus a
client-mode peer: every key is found from every node, the latest value wins everywhere, owner
signatures hold across the network, and gets survive the loss of 30% of the nodes.

The tests share one network and run in file order; the last one kills nodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import statistics
import time

import msgpack
import pytest
from localswarm import Swarm

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, owner_marker
from swarm.dht.ids import DHTID
from swarm.dht.keys import key_to_bytes
from swarm.dht.validation import DHTRecord, signed_bytes
from swarm.dht.wire import INVALID

SIZE = 50
CONFIG = DHTConfig(lookup_timeout=5.0)  # dead nodes here refuse connections: no request waits its timeout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def network():
    swarm = Swarm()
    for i in range(SIZE):
        swarm.add(config=CONFIG, identity=Identity.from_seed(hashlib.sha256(b"node%d" % i).digest()))
    client = swarm.add(config=CONFIG, client_mode=True)
    yield swarm.peers[:SIZE], client, swarm
    swarm.close()


def test_every_node_joined_and_knows_its_neighbourhood(network):
    nodes, client, _ = network
    sizes = [len(peer.dht.node.routing_table) for peer in [*nodes, client]]
    assert min(sizes) >= 10 and statistics.median(sizes) >= 20, sizes
    for peer in nodes:  # each node knows most of its nearest neighbours (they met while joining)
        nearest = sorted(nodes, key=lambda other: other.dht.node.node_id ^ peer.dht.node.node_id)[1:6]
        known = sum(peer.dht.node.routing_table.get(peer_id=other.peer_id) is not None for other in nearest)
        assert known >= 3, (peer.peer_id, known)


def test_every_stored_key_is_found_from_every_node(network):
    nodes, client, _ = network
    now = get_dht_time()
    rng = random.Random(1)
    keys = [f"key-{i}" for i in range(20)]
    for i, key in enumerate(keys):
        writer = rng.choice([*nodes, client])
        assert writer.dht.store(key, {"i": i}, now + 300), key
    for peer in [*nodes, client]:
        found = peer.dht.get_many(keys)
        missing = [k for k, v in found.items() if v is None]
        assert not missing, (peer.peer_id, missing)
        assert [found[k].value for k in keys] == [{"i": i} for i in range(20)]


def test_a_later_expiration_replaces_the_earlier_value_everywhere_it_is_fetched_with_latest(network):
    nodes, client, _ = network
    now = get_dht_time()
    assert nodes[3].dht.store("versioned", "v1", now + 60)
    assert all(p.dht.get("versioned").value == "v1" for p in nodes)  # now cached all over
    assert nodes[40].dht.store("versioned", "v2", now + 120)
    for peer in [*nodes, client]:
        assert peer.dht.get("versioned", latest=True) == ("v2", now + 120), peer.peer_id
    # subkeys: each keeps its own expiration; a later one replaces just that subkey
    assert nodes[7].dht.store("board", "a1", now + 60, subkey="a")
    assert nodes[8].dht.store("board", "b1", now + 60, subkey="b")
    assert nodes[9].dht.store("board", "a2", now + 90, subkey="a")
    for peer in nodes[::5]:
        board = peer.dht.get("board", latest=True).value
        assert {k: v.value for k, v in board.items()} == {"a": "a2", "b": "b1"}


def test_the_client_mode_peer_never_appears_in_a_routing_table(network):
    nodes, client, _ = network
    assert client.dht.store("client-was-here", 1, get_dht_time() + 60)
    assert nodes[25].dht.get("client-was-here").value == 1  # it stores and finds through the others
    assert nodes[5].dht.store("for-the-client", 2, get_dht_time() + 60)
    assert client.dht.get("for-the-client").value == 2
    for peer in nodes:
        table = peer.dht.node.routing_table
        assert table.get(peer_id=client.peer_id) is None
        assert all(n.peer_id != client.peer_id for n in table)


def test_signed_records_hold_across_the_network(network):
    nodes, client, _ = network
    alice, mallory = nodes[11], nodes[12]
    now = get_dht_time()
    key = "alice" + owner_marker(alice.peer_id)
    assert alice.dht.store(key, "genuine", now + 60)
    key_id = DHTID.from_key(key)
    nearest = mallory.run(mallory.dht.node.find_nearest_nodes([key_id], beam_size=5))[key_id]
    protocol = mallory.dht.node.protocol
    # a forgery: Mallory signs a value for Alice's key with her own key
    plain = DHTRecord.create(key, "forged", now + 120)
    forged = dataclasses.replace(
        plain, value=msgpack.packb([plain.value, mallory.identity.sign(signed_bytes(plain, plain.value))]))
    # a replay: Alice's genuine signed value, taken from a replica, moved to a later expiration
    holder = next(p for p in nodes if p.dht.node.storage.get(key_to_bytes(key)) is not None)
    genuine = holder.dht.node.storage.get(key_to_bytes(key))
    replayed = DHTRecord(key_to_bytes(key), b"", genuine.value, now + 600, plain.raw_key)
    for record, reason in ((forged, "signature is not"), (replayed, "signature is not")):
        from swarm.dht.wire import store_item

        answers = [mallory.run(protocol.call_store(node, [store_item(record)])) for node in nearest]
        assert all(a is not None and a[0].status == INVALID and reason in a[0].reason for a in answers), answers
    for peer in (*nodes[::7], client):
        assert peer.dht.get(key, latest=True) == ("genuine", now + 60)


@pytest.mark.timeout(120)
def test_gets_survive_killing_30_percent_of_the_nodes(network):
    nodes, client, swarm = network
    now = get_dht_time()
    keys = [f"durable-{i}" for i in range(16)]
    assert all(nodes[1].dht.store_many(keys, list(range(16)), now + 300))
    assert nodes[1].run(nodes[1].dht.node.wait_for_stores(timeout=5))  # every replica written before the kills
    rng = random.Random(7)
    victims = rng.sample(nodes[2:], int(0.3 * SIZE))  # keep nodes[0] (owns the loop) and the writer
    for victim in victims:
        swarm.kill(victim)
    survivors = [p for p in nodes if p not in victims]
    key_ids = {k: key_to_bytes(k) for k in keys}
    replicated = [k for k in keys if any(p.dht.node.storage.get(key_ids[k]) is not None for p in survivors)]
    assert len(replicated) >= len(keys) - 1  # with 5 replicas, losing all of a key's is rare
    for peer in [*survivors, client]:
        start = time.monotonic()
        found = peer.dht.get_many(replicated)
        assert time.monotonic() - start < CONFIG.lookup_timeout
        assert [found[k].value for k in replicated] == [keys.index(k) for k in replicated], peer.peer_id
    # the dead are noticed and dropped from the routing tables of those who tried them
    dead = {v.peer_id for v in victims}
    tried = [p for p in survivors if any(p.dht.node.blacklist.is_banned(d) for d in dead)]
    assert tried
    for peer in tried:
        banned = {d for d in dead if peer.dht.node.blacklist.is_banned(d)}
        assert not any(peer.dht.node.routing_table.get(peer_id=d) for d in banned)
