"""Routing-table upkeep (swarm.dht.contacts): who enters the table and who is announced as new (no
sockets), and, between real peers, a node that shuts down cleanly says goodbye and its contacts
drop it at once, without a failed call."""

from __future__ import annotations

import time

from swarm.core.errors import DeadlineExceeded
from swarm.core.identity import Identity
from swarm.dht import DHTConfig, FaultPlan, LinkFault
from swarm.dht.blacklist import Blacklist
from swarm.dht.buckets import NodeInfo
from swarm.dht.contacts import Contacts
from swarm.dht.routing import RoutingTable
from swarm.dht.wire import LEAVE, node_id_of


def contacts_of_a_new_node() -> tuple[Contacts, list[NodeInfo]]:
    async def ping(node: NodeInfo) -> bool:
        raise AssertionError("no bucket fills up here")

    table = RoutingTable(node_id_of(Identity.generate().peer_id), bucket_size=20)
    others = [Identity.generate().peer_id for _ in range(3)]
    nodes = [NodeInfo(node_id_of(p), p, f"/ip4/127.0.0.1/tcp/{4000 + i}/p2p/{p}") for i, p in enumerate(others)]
    return Contacts(table, Blacklist(), ping), nodes


def test_only_nodes_new_to_the_table_are_announced():
    contacts, nodes = contacts_of_a_new_node()
    announced = []
    contacts.on_new_node = announced.append
    for node in (*nodes, *nodes, nodes[0]):  # the same nodes heard from again are not new
        contacts.heard_from(node)
    assert announced == nodes
    contacts.routing_table.remove(nodes[1].node_id)  # dropped (it failed), then back: new again
    contacts.heard_from(nodes[1])
    assert announced == [*nodes, nodes[1]]


def test_a_departed_node_stays_out_for_a_grace_period():
    contacts, nodes = contacts_of_a_new_node()
    for node in nodes:
        contacts.heard_from(node)
    contacts.departed(nodes[0].peer_id)
    assert nodes[0].node_id not in contacts.routing_table
    contacts.heard_from(nodes[0])  # a late answer from it while it shuts down
    contacts.answered(nodes[0])
    assert nodes[0].node_id not in contacts.routing_table
    contacts._departed[nodes[0].peer_id] = time.monotonic() - 1  # the grace period is over: it came back
    contacts.heard_from(nodes[0])
    assert nodes[0].node_id in contacts.routing_table
    assert not contacts.blacklist.is_banned(nodes[0].peer_id)


def test_a_timeout_makes_reads_patient_for_a_while_only():
    """`timed_out_within` (what `DHT.read_patience` asks): a recent timeout says others' reads may
    still wait on that node; one long past does not, even if the node never answered again."""
    contacts, nodes = contacts_of_a_new_node()
    for node in nodes:
        contacts.heard_from(node)
    assert not contacts.timed_out_within(60.0)  # nothing timed out yet
    contacts.failed(nodes[0], DeadlineExceeded("no answer"), "/swarm.DHT/Find")
    assert contacts.is_suspect(nodes[0].peer_id) and contacts.timed_out_within(60.0)
    contacts._last_timeout = time.monotonic() - 61.0  # a minute later, still a suspect
    assert contacts.is_suspect(nodes[0].peer_id) and not contacts.timed_out_within(60.0)


def failed_calls(peer) -> int:
    return sum(peer.dht.node.protocol.contacts.failures.values())


def test_a_node_that_shuts_down_says_goodbye_and_its_contacts_drop_it_at_once(swarm):
    peers = swarm.grow(5)
    leaving = peers[3]
    contacts = [p for p in peers if p.dht.node.routing_table.get(peer_id=leaving.peer_id) is not None]
    assert len(contacts) >= 3
    failures = {p.peer_id: failed_calls(p) for p in contacts}
    sent = {p.peer_id: sum(p.dht.node.protocol.calls_sent.values()) for p in contacts}
    told = len(leaving.dht.node.routing_table)
    leaving.shutdown()  # returns once every contact took note (or `leave_timeout` passed)
    assert leaving.dht.node.protocol.calls_sent[LEAVE] == told
    for peer in contacts:
        node = peer.dht.node
        assert node.routing_table.get(peer_id=leaving.peer_id) is None
        assert all(n.peer_id != leaving.peer_id for n in node.routing_table)
        # it learnt it from the goodbye, not from calls that failed
        assert failed_calls(peer) == failures[peer.peer_id]
        assert sum(node.protocol.calls_sent.values()) == sent[peer.peer_id]
        assert not node.blacklist.is_banned(leaving.peer_id)
    # the others still reach each other, and what the leaver told them does not bring it back
    assert peers[1].dht.store("after-goodbye", 1, time.time() + 60)
    assert peers[4].dht.get("after-goodbye").value == 1
    assert all(p.dht.node.routing_table.get(peer_id=leaving.peer_id) is None for p in contacts)


def test_a_goodbye_nobody_answers_holds_up_shutdown_for_leave_timeout_at_most(swarm):
    plan = FaultPlan()
    config = DHTConfig(request_timeout=30.0, lookup_timeout=60.0, leave_timeout=0.3, fault_plan=plan)
    peers = [swarm.add(config=config) for _ in range(3)]
    leaving = peers[2]
    for other in peers[:2]:
        plan.set_link(leaving.peer_id, other.peer_id, LinkFault(loss=1.0))  # its goodbyes are lost
    start = time.monotonic()
    leaving.shutdown()
    assert time.monotonic() - start < 10.0  # not the 30 s a lost request waits for otherwise
    # not told, the others keep it until a call to it fails (the usual way)
    assert any(p.dht.node.routing_table.get(peer_id=leaving.peer_id) is not None for p in peers[:2])


def test_a_crash_says_no_goodbye(swarm):
    peers = swarm.grow(3)
    swarm.kill(peers[2])  # `shutdown(leave=False)`: as a crash would
    assert peers[2].dht.node.protocol.calls_sent[LEAVE] == 0
    assert peers[1].dht.node.routing_table.get(peer_id=peers[2].peer_id) is not None
