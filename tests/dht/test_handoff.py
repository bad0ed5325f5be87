"""Handing records over to new nodes (swarm.dht.handoff): which records go to which newcomer (pure
logic, no sockets), and a newcomer to a real swarm that comes to hold the records it is now among
the nearest nodes of, with no republication timer running."""

from __future__ import annotations

import hashlib

from localswarm import wait_until

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.dht.buckets import NodeInfo
from swarm.dht.handoff import newcomers_to_serve
from swarm.dht.ids import DHTID
from swarm.dht.keys import key_to_bytes

KEY = DHTID(0b1000 << 250)


def node(distance: int) -> NodeInfo:
    """A node at XOR distance `distance` from KEY."""
    node_id = DHTID(KEY ^ distance)
    return NodeInfo(node_id, f"peer{distance}", f"/ip4/127.0.0.1/tcp/{distance % 60000 + 1}")


def serve(own: int, table: list[int], new: list[int], replicas: int = 3) -> list[int]:
    nearest = sorted((node(d) for d in table), key=lambda n: n.node_id ^ KEY)
    served = newcomers_to_serve(KEY, DHTID(KEY ^ own), nearest, {node(d).node_id for d in new}, replicas)
    return [n.node_id ^ KEY for n in served]


def test_the_nearest_old_holder_hands_a_record_to_newcomers_among_the_nearest():
    assert serve(own=5, table=[1, 10, 20, 30], new=[1]) == [1]  # nearer than this node
    assert serve(own=5, table=[10, 12, 20], new=[12]) == [12]  # third of three
    assert serve(own=5, table=[1, 2, 10, 20], new=[1, 2]) == [1, 2]
    assert serve(own=5, table=[1, 2, 3, 10], new=[1, 2, 3]) == [1, 2, 3]  # this node drops out of the three


def test_no_hand_off_by_a_node_that_is_not_the_nearest_old_holder_or_to_a_node_too_far():
    assert serve(own=5, table=[3, 10, 20], new=[10]) == []  # old node 3 is nearer: it hands over
    assert serve(own=5, table=[1, 3, 10], new=[1]) == []  # same, with the newcomer nearest of all
    assert serve(own=5, table=[6, 7, 30], new=[30]) == []  # the newcomer is fourth: holds nothing
    assert serve(own=5, table=[6, 7, 8], new=[]) == []


def test_a_small_table_serves_every_newcomer_while_there_are_fewer_than_the_replicas():
    assert serve(own=5, table=[40], new=[40]) == [40]
    assert serve(own=5, table=[], new=[]) == []


def seeded(i: int) -> Identity:
    return Identity.from_seed(hashlib.sha256(b"handoff%d" % i).digest())


def test_a_newcomer_gets_the_records_it_is_now_among_the_nearest_nodes_of(swarm):
    config = DHTConfig(request_timeout=1.0, lookup_timeout=5.0, num_replicas=3)  # republication: every 600 s
    peers = [swarm.add(config=config, identity=seeded(i)) for i in range(8)]
    now = get_dht_time()
    keys = [f"handoff-{i}" for i in range(60)]
    assert all(peers[1].dht.store_many(keys, list(range(60)), now + 300))

    def held_by(peer) -> set[str]:
        return {k for k in keys if peer.dht.node.storage.get(key_to_bytes(k)) is not None}

    assert peers[1].run(peers[1].dht.node.wait_for_stores(timeout=5))
    assert sum(len(held_by(p)) for p in peers) == 3 * len(keys)
    newcomer = swarm.add(config=config, identity=seeded(100))
    everyone = [p.dht.node.node_id for p in [*peers, newcomer]]

    def among_nearest(key: str) -> bool:
        key_id = DHTID.from_key(key)
        return newcomer.dht.node.node_id in sorted(everyone, key=lambda n: n ^ key_id)[:3]

    expected = {k for k in keys if among_nearest(k)}
    assert expected
    assert wait_until(lambda: held_by(newcomer) == expected, timeout=5)
    # each record came from one node (the nearest of those that held it), not from every replica
    assert wait_until(lambda: sum(p.dht.node.handoff.handed_over for p in peers) >= len(expected), timeout=5)
    assert sum(p.dht.node.handoff.handed_over for p in peers) == len(expected)
    assert newcomer.dht.get_many(sorted(expected)) == peers[5].dht.get_many(sorted(expected))
