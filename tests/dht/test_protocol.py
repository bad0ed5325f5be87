"""The DHT wire protocol between real peers: who gets into routing tables, batched Store and Find,
the reasons a refused record comes back with, and how failed calls are handled."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgpack
import pytest

from swarm.core.errors import InvalidRequest
from swarm.core.faults import FaultPlan, LinkFault
from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, SignatureValidator, owner_marker
from swarm.dht.buckets import NodeInfo
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.ids import DHTID
from swarm.dht.validation import DHTRecord, signed_bytes
from swarm.dht.wire import FIND, INVALID, OUTDATED, REFUSED, STORED, node_id_of, store_item
from swarm.proto import dht_pb2


def info(peer) -> NodeInfo:
    return NodeInfo(node_id_of(peer.peer_id), peer.peer_id, peer.addrs[0])


def record(key, value, expiration_time, subkey=None, signer: Identity | None = None) -> DHTRecord:
    plain = DHTRecord.create(key, value, expiration_time, subkey)
    if signer is None:
        return plain
    return dataclasses.replace(plain, value=SignatureValidator(signer).sign_value(plain))


def forge(key, value, expiration_time, forger: Identity) -> DHTRecord:
    """A record signed, in the owner's format, by someone who is not the owner."""
    plain = DHTRecord.create(key, value, expiration_time)
    signature = forger.sign(signed_bytes(plain, plain.value))
    return dataclasses.replace(plain, value=msgpack.packb([plain.value, signature], use_bin_type=True))


def test_a_request_teaches_the_callee_about_the_caller_but_not_in_client_mode(swarm):
    a = swarm.add()
    b = swarm.add(initial=[])
    client = swarm.add(initial=[], client_mode=True)
    assert b.run(b.dht.node.protocol.call_ping(info(a)))
    assert client.run(client.dht.node.protocol.call_ping(info(a)))
    table = a.dht.node.routing_table
    assert table.get(peer_id=b.peer_id).addr == b.addrs[0]
    assert table.get(peer_id=client.peer_id) is None
    # the caller learns about the callee from its answer
    assert b.dht.node.routing_table.get(peer_id=a.peer_id) is not None
    assert client.dht.node.routing_table.get(peer_id=a.peer_id) is not None


def test_a_claimed_address_is_trusted_only_for_the_authenticated_peer_id(swarm):
    a, b = swarm.add(), swarm.add()
    mallory = swarm.add(initial=[])
    protocol = mallory.dht.node.protocol
    # Mallory claims to be reachable at b's address: her own entry gets it, b's entry is untouched
    protocol._caller = dht_pb2.DHTCaller(addrs=[b.addrs[0].split("/p2p/")[0]])
    assert mallory.run(protocol.call_ping(info(a)))
    table = a.dht.node.routing_table
    assert table.get(peer_id=b.peer_id).addr == b.addrs[0]
    assert table.get(peer_id=mallory.peer_id).addr.endswith(f"/p2p/{mallory.peer_id}")
    # and the lie does not survive contact: the peer at that address cannot prove it is Mallory
    assert not a.run(a.dht.node.protocol.call_ping(table.get(peer_id=mallory.peer_id)))
    assert table.get(peer_id=mallory.peer_id) is None


def test_store_is_batched_and_says_why_each_refused_record_was_refused(swarm):
    a, b = swarm.add(), swarm.add()
    alice = Identity.generate()
    now = get_dht_time()
    owned = "status" + owner_marker(alice.peer_id)
    good = record(owned, "fine", now + 60, signer=alice)
    forged = forge(owned, "forged", now + 60, Identity.generate())
    unsigned = record(owned, "unsigned", now + 60)
    replayed = dataclasses.replace(good, expiration_time=now + 120)  # Alice's signature, another expiration
    moved = record("other" + owner_marker(alice.peer_id), None, now + 60)
    moved = dataclasses.replace(good, key=moved.key, raw_key=moved.raw_key)  # Alice's signature on another key
    plain = record("plain", 1, now + 60)
    older = record("plain", 0, now + 30)
    expired = record("gone", 1, now - 1)
    items = [store_item(r) for r in (good, forged, unsigned, replayed, moved, plain, older, expired)]
    items.append(dht_pb2.DHTStoreItem(raw_key=b"\xa3big", value=b"x" * (2 << 20), expiration_time=now + 60))
    items.append(dht_pb2.DHTStoreItem(raw_key=b"\xa3nan", value=b"\x01", expiration_time=float("nan")))
    results = b.run(b.dht.node.protocol.call_store(info(a), items))
    statuses = [r.status for r in results]
    assert statuses == [STORED, INVALID, INVALID, INVALID, INVALID, STORED, OUTDATED, OUTDATED, REFUSED, INVALID]
    assert "signature is not" in results[1].reason and alice.peer_id in results[1].reason
    assert "carries no signature" in results[2].reason
    assert "signature is not" in results[3].reason and "signature is not" in results[4].reason
    assert "later is already stored" in results[6].reason
    assert "exceeds" in results[8].reason
    # what was stored keeps its original key, so that it can be forwarded and checked again
    storage = a.dht.node.storage
    assert storage.raw_key(good.key) == good.raw_key and storage.get(good.key).value == good.value


def test_find_answers_many_keys_in_one_call(swarm):
    peers = [swarm.add() for _ in range(6)]
    a, b = peers[0], peers[1]
    now = get_dht_time()
    storage = a.dht.node.storage
    plain = record("k1", "v1", now + 60)
    storage.store(plain.key, plain.value, plain.expiration_time, raw_key=plain.raw_key)
    sub = record("k2", "v2", now + 60, subkey="s")
    storage.store(sub.key, sub.value, sub.expiration_time, sub.subkey, sub.raw_key)
    missing = DHTID.from_key("missing")
    keys = [DHTID.from_bytes(plain.key), DHTID.from_bytes(sub.key), missing]
    protocol = b.dht.node.protocol
    answers = b.run(protocol.call_find(info(a), keys))
    assert answers[keys[0]].value == (plain.value, plain.expiration_time)
    assert isinstance(answers[keys[1]].value.value, DictionaryValue)
    assert answers[keys[1]].value.value.get(sub.subkey) == (sub.value, sub.expiration_time)
    assert answers[missing].value is None
    for key in keys:  # nearest nodes of a's table, without the caller itself
        nearest = answers[key].nearest
        assert nearest and b.peer_id not in {n.peer_id for n in nearest}
        assert nearest == sorted(nearest, key=lambda n: n.node_id ^ key)
    suffice = b.run(protocol.call_find(info(a), keys, values_suffice=True, count=2))
    assert suffice[keys[0]].nearest == [] and len(suffice[missing].nearest) == 2
    nodes_only = b.run(protocol.call_find(info(a), keys, nodes_only=True))
    assert nodes_only[keys[0]].value is None and nodes_only[keys[0]].nearest


def test_malformed_find_gets_a_clear_error_and_the_server_keeps_serving(swarm):
    a, b = swarm.add(), swarm.add()
    request = dht_pb2.DHTFindRequest(keys=[b"short"])
    with pytest.raises(InvalidRequest, match="32 bytes"):
        b.run(b.pool.get(a.addrs[0]).unary(FIND, request, dht_pb2.DHTFindResponse))
    with pytest.raises(InvalidRequest, match="malformed"):
        b.run(b.pool.get(a.addrs[0]).unary(FIND, b"\xff\xff\xff", dht_pb2.DHTFindResponse))
    assert b.run(b.dht.node.protocol.call_ping(info(a)))


def test_a_dead_peer_is_dropped_and_blacklisted_with_backoff(swarm):
    a = swarm.add()
    b = swarm.add()
    c = swarm.add()
    node = a.dht.node
    gone = info(c)
    assert node.routing_table.get(peer_id=c.peer_id) is not None
    swarm.kill(c)
    assert not a.run(node.protocol.call_ping(gone))
    assert node.routing_table.get(peer_id=c.peer_id) is None
    first_ban = node.blacklist.banned_until(c.peer_id)
    assert first_ban is not None
    # a banned peer is skipped by lookups, and its requests do not bring it back while banned
    assert a.run(node.protocol.call_find(gone, [DHTID(1)])) is None
    node.blacklist._banned_until[c.peer_id] = time.time() - 0.01
    assert not a.run(node.protocol.call_ping(gone))
    second = node.blacklist.banned_until(c.peer_id)
    assert second is not None and second - get_dht_time() > node.config.blacklist_base_time * 1.5
    assert b.run(b.dht.node.protocol.call_ping(info(a)))  # the living are unaffected


def test_a_request_that_fails_on_a_closed_channel_leaves_the_callers_fresh_channel_open(swarm):
    """A DHT request in flight on a channel that its owner closes fails as unreachable, and the DHT
    then closes "the node's channel" (the node is out of its table). By then the owner has dialled
    afresh: that new channel must stay open. Before, the DHT closed it mid-handshake, and a revoked
    peer's fresh dial failed as "channel closed" instead of hearing why it was refused."""
    holder = swarm.add()
    plan = FaultPlan()
    caller = swarm.add(config=DHTConfig(request_timeout=10.0, lookup_timeout=20.0, fault_plan=plan))
    node = caller.dht.node

    async def go() -> None:
        old = caller.pool.known(holder.peer_id)
        assert old is not None and node.routing_table.get(peer_id=holder.peer_id) is not None
        node.routing_table.remove(node_id_of(holder.peer_id))  # as after an earlier failure
        plan.set_peer(holder.peer_id, LinkFault(delay=0.5))  # the ping waits on its way out, on `old`
        delayed = plan.stats.delayed
        ping = asyncio.ensure_future(node.protocol.call_ping(info(holder)))
        for _ in range(10_000):  # until the ping is inside its delay, holding `old` (a few loop turns)
            if plan.stats.delayed > delayed:
                break
            await asyncio.sleep(0)
        assert plan.stats.delayed > delayed
        plan.set_peer(holder.peer_id, LinkFault())
        await caller.pool.forget(holder.peer_id)  # the owner closes `old` and dials afresh
        fresh = caller.pool.get(holder.addrs[0])
        assert not await ping  # it failed on the closed channel ...
        assert caller.pool.known(holder.peer_id) is fresh  # ... and left the new one alone
        await fresh.info(timeout=5)

    caller.run(go(), timeout=30)


def test_a_full_bucket_keeps_live_contacts_and_replaces_dead_ones(swarm):
    """§2.2: a newcomer to a full bucket waits while the least-recently seen contact answers a
    ping, and takes its place once it does not."""
    from localswarm import wait_until

    from swarm.dht import DHTConfig

    def identity_with_top_bit(bit: int, seed: int = 0) -> Identity:
        while True:
            seed += 1
            identity = Identity.from_seed(seed.to_bytes(32, "big"))
            if DHTID.from_peer_id(identity.peer_id) >> 255 == bit:
                return identity

    tiny = DHTConfig(bucket_size=1, depth_modulo=1, request_timeout=1.0)
    a = swarm.add(config=tiny, identity=identity_with_top_bit(0))
    b = swarm.add(config=tiny, identity=identity_with_top_bit(1))
    c = swarm.add(initial=[], config=tiny, identity=identity_with_top_bit(1, seed=int.from_bytes(b"c" * 4, "big")))
    d = swarm.add(initial=[], config=tiny, identity=identity_with_top_bit(1, seed=int.from_bytes(b"d" * 4, "big")))
    table = a.dht.node.routing_table
    assert table.get(peer_id=b.peer_id) is not None
    assert c.run(c.dht.node.protocol.call_ping(info(a)))
    assert wait_until(lambda: not a.dht.node.protocol.contacts.pinging, timeout=5)
    assert table.get(peer_id=b.peer_id) is not None and table.get(peer_id=c.peer_id) is None  # b answered
    swarm.kill(b)
    a.dht.node.protocol.contacts.checked.clear()
    assert d.run(d.dht.node.protocol.call_ping(info(a)))
    assert wait_until(lambda: table.get(peer_id=b.peer_id) is None, timeout=5)
    assert table.get(peer_id=d.peer_id) is not None or table.get(peer_id=c.peer_id) is not None


def test_a_lost_request_is_forgiven_but_a_node_that_keeps_timing_out_is_dropped(swarm):
    from swarm.dht import DHTConfig, FaultPlan, LinkFault

    plan = FaultPlan()
    config = DHTConfig(request_timeout=0.2, fault_plan=plan)
    a = swarm.add(config=config)
    b = swarm.add(config=config)
    node = a.dht.node
    plan.set_link(a.peer_id, b.peer_id, LinkFault(loss=1.0))
    for _ in range(2):
        assert not a.run(node.protocol.call_ping(info(b)))
        assert node.routing_table.get(peer_id=b.peer_id) is not None and not node.blacklist.is_banned(b.peer_id)
    plan.clear()
    assert a.run(node.protocol.call_ping(info(b)))  # an answer resets the count
    plan.set_link(a.peer_id, b.peer_id, LinkFault(loss=1.0))
    for _ in range(3):
        a.run(node.protocol.call_ping(info(b)))
    assert node.routing_table.get(peer_id=b.peer_id) is None and node.blacklist.is_banned(b.peer_id)
