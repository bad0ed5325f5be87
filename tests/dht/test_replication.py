"""Stores between real peers (swarm.dht.replication): a store returns once the nearest replica holds
the record and the others follow in the background, the lookup runs only when the first round
shows the writer did not know the nearest nodes, and a writer that shuts down cancels what is left."""

from __future__ import annotations

import logging

from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, FaultPlan, LinkFault
from swarm.dht.ids import DHTID
from swarm.dht.keys import key_to_bytes
from swarm.dht.wire import FIND, STORE

SLOW = 1.5  # seconds added to the links to every replica but the nearest: which replicas hold a record
# when a call returns shows whether it waited for them (a store on its own takes milliseconds)


def by_distance(peers, key):
    key_id = DHTID.from_key(key)
    return sorted(peers, key=lambda p: p.dht.node.node_id ^ key_id)


def holders(peers, key) -> list:
    return [p for p in peers if p.dht.node.storage.get(key_to_bytes(key)) is not None]


def slow_replicas(swarm, key, delay=SLOW):
    """Six peers and a client-mode writer whose links to the replicas of `key`, but the nearest, are slow."""
    plan = FaultPlan()
    config = DHTConfig(request_timeout=3.0, lookup_timeout=10.0, fault_plan=plan)
    peers = [swarm.add(config=config) for _ in range(6)]
    writer = swarm.add(config=config, client_mode=True)
    replicas = by_distance(peers, key)[: config.num_replicas]
    for replica in replicas[1:]:
        plan.set_link(writer.peer_id, replica.peer_id, LinkFault(delay=delay))
    return peers, writer, replicas


def test_a_store_returns_once_the_nearest_replica_has_it_and_the_others_follow(swarm):
    peers, writer, replicas = slow_replicas(swarm, "hurry")
    assert writer.dht.store("hurry", "now", get_dht_time() + 60)
    # it returned without waiting for the slow replicas: only the nearest, the node any reader asks first, has it
    assert holders(peers, "hurry") == replicas[:1]
    assert peers[0].dht.get("hurry").value == "now"
    assert writer.run(writer.dht.node.wait_for_stores(timeout=5))  # the others, written in the background
    assert set(holders(peers, "hurry")) == set(replicas)


def test_a_clean_shutdown_lets_the_last_replicas_be_written(swarm):
    peers, writer, replicas = slow_replicas(swarm, "last-words", delay=0.1)
    assert writer.dht.store("last-words", 1, get_dht_time() + 60)
    assert len(holders(peers, "last-words")) < len(replicas)
    writer.shutdown()  # waits up to `leave_timeout` for them
    assert set(holders(peers, "last-words")) == set(replicas)


def test_replicas_still_in_flight_are_cancelled_when_the_writer_stops(swarm, caplog):
    peers, writer, replicas = slow_replicas(swarm, "short-lived")
    assert writer.dht.store("short-lived", 1, get_dht_time() + 60)
    assert writer.dht.node._tasks  # the slow replicas are still being written to
    with caplog.at_level(logging.WARNING):
        writer.shutdown()  # they get `leave_timeout` (0.5 s) to finish, which is not enough here
    assert not writer.dht.node._tasks
    assert not [r for r in caplog.records if "destroyed" in r.getMessage() or "failed" in r.getMessage()]
    assert holders(peers, "short-lived") == replicas[:1]  # it did not wait for them


def test_a_store_needs_no_lookup_when_the_writer_knows_the_nearest_nodes(swarm):
    peers = swarm.grow(8)
    writer = swarm.add(client_mode=True)
    protocol = writer.dht.node.protocol
    before = dict(protocol.calls_sent)
    assert writer.dht.store("settled", 1, get_dht_time() + 60)
    assert writer.run(writer.dht.node.wait_for_stores(timeout=5))
    assert len(holders(peers, "settled")) == writer.dht.config.num_replicas
    assert protocol.calls_sent[STORE] - before.get(STORE, 0) == writer.dht.config.num_replicas
    assert protocol.calls_sent[FIND] == before.get(FIND, 0)  # the stores' answers were the whole lookup


def test_a_store_reaches_a_nearest_node_the_writer_did_not_know(swarm):
    peers = swarm.grow(8)
    writer = peers[1]
    others = [p for p in peers if p is not writer]
    nearest = by_distance(others, "hidden")[0]

    async def forget() -> None:
        writer.dht.node.routing_table.remove(nearest.dht.node.node_id)

    writer.run(forget())
    assert writer.dht.node.routing_table.get(peer_id=nearest.peer_id) is None
    assert writer.dht.store("hidden", 1, get_dht_time() + 60)
    # the first round's answers named it: the lookup found it and it got the record
    assert writer.run(writer.dht.node.wait_for_stores(timeout=5))
    assert nearest.dht.node.storage.get(key_to_bytes("hidden")) is not None
