"""`peer.dht` on a small swarm of real peers in one process: the SPEC §3 API and §4 semantics,
validators across the network, caching, republication, refresh, joining, and link faults."""

from __future__ import annotations

import asyncio
import time

import pydantic
import pytest
from localswarm import FAST, wait_until

from swarm.core.errors import DHTError, ValidationError
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHT, DHTConfig, FaultPlan, LinkFault, SchemaValidator, ValueWithExpiration, owner_marker
from swarm.dht.keys import key_to_bytes
from swarm.dht.wire import FIND, PING


def dead_addr() -> str:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"


def test_store_and_get_plain_values_and_dictionaries(swarm):
    peers = swarm.grow(8)
    a, b = peers[2], peers[6]
    now = get_dht_time()
    assert isinstance(a.dht, DHT)
    assert a.dht.store("plain", {"x": [1, 2], "y": b"bytes"}, now + 60)
    found = b.dht.get("plain")
    assert found == ValueWithExpiration({"x": [1, 2], "y": b"bytes"}, now + 60)
    assert found.value == {"x": [1, 2], "y": b"bytes"} and found.expiration_time == now + 60
    assert a.dht.store("dict", "one", now + 60, subkey="a")
    assert b.dht.store("dict", 2, now + 70, subkey=7)
    got = peers[4].dht.get("dict", latest=True)
    assert got.expiration_time == now + 70
    assert got.value == {"a": ValueWithExpiration("one", now + 60), 7: ValueWithExpiration(2, now + 70)}
    assert b.dht.get("nothing here") is None
    assert b.dht.get(b"bytes key") is None and a.dht.store(b"bytes key", 1, now + 60)
    assert b.dht.get(b"bytes key").value == 1 and b.dht.get("bytes key") is None  # str and bytes differ


def test_later_expiration_wins_and_expired_values_vanish(swarm):
    peers = swarm.grow(6)
    now = get_dht_time()
    assert peers[1].dht.store("k", "first", now + 60)
    assert peers[2].dht.store("k", "second", now + 120)
    key = key_to_bytes("k")

    def replicas_with_second() -> int:
        return sum(getattr(p.dht.node.storage.get(key), "expiration_time", None) == now + 120 for p in peers)

    # a store returns once the nearest replica has it; the others are written in the background
    assert peers[2].run(peers[2].dht.node.wait_for_stores(timeout=5))
    assert replicas_with_second() == FAST.num_replicas
    assert not peers[3].dht.store("k", "stale", now + 90)  # every replica has a later one
    assert peers[4].dht.get("k", latest=True) == ("second", now + 120)
    assert not peers[1].dht.store("old", 1, now - 1)
    assert peers[1].dht.store("short", 1, get_dht_time() + 0.5)
    assert peers[5].dht.get("short", latest=True) is not None
    assert wait_until(lambda: peers[5].dht.get("short", latest=True) is None, timeout=5)
    assert peers[4].dht.get("short") is None  # gone from caches too


def test_awaitable_forms_work_inside_the_peers_loop_and_in_another_loop(swarm):
    a, b = swarm.grow(2)
    now = get_dht_time()

    async def inside() -> tuple:
        stored = await a.dht.astore("async", 1, now + 60)
        many = await a.dht.astore_many(["m1", "m2", "m3"], [1, 2, 3], now + 60, subkeys=[None, "s", None])
        return stored, many, await a.dht.aget("async"), await a.dht.aget_many(["m1", "m2", "none"])

    stored, many, got, got_many = a.run(inside())
    assert stored and many == [True, True, True] and got.value == 1
    assert got_many["m1"].value == 1 and got_many["m2"].value == {"s": ValueWithExpiration(2, now + 60)}
    assert got_many["none"] is None
    # from an unrelated event loop (a notebook cell), through the same a* methods
    assert asyncio.run(b.dht.aget("m3")).value == 3
    assert asyncio.run(b.dht.astore("other-loop", 4, now + 60))
    assert b.dht.get_many(["other-loop", "m1"])["other-loop"].value == 4
    assert b.dht.store_many(["x", "y"], [1, 2], [now + 60, now + 61]) == [True, True]
    with pytest.raises(RuntimeError, match="a\\* form"):
        a.run(_call_blocking_inside(a))


async def _call_blocking_inside(peer):
    return peer.dht.get("x")


def test_concurrent_single_gets_are_coalesced_into_shared_requests(swarm):
    peers = swarm.grow(6)
    client = swarm.add(client_mode=True, config=DHTConfig(request_timeout=1.0, cache_size=0))
    now = get_dht_time()
    keys = [f"c{i}" for i in range(200)]
    assert all(peers[1].dht.store_many(keys, list(range(200)), now + 60))
    protocol = client.dht.node.protocol
    before = protocol.calls_sent[FIND]

    async def many() -> list:
        return await asyncio.gather(*(client.dht.aget(k) for k in keys))

    results = client.run(many())
    assert [r.value for r in results] == list(range(200))
    # every key was looked up on the network, yet the requests went out batched: one lookup per
    # key would send 200 or more. How many batched requests go out is a timing figure (an answer
    # slower than `slow_after` is hedged with another request, more often on a loaded machine:
    # 18 with 6 nodes was seen at load ~4, 2 per node on a quiet one), so the bound is on batching.
    assert protocol.calls_sent[FIND] - before < len(keys) // 4
    assert client.dht.node.stats.lookups >= 200


def test_found_values_are_cached_here_and_at_the_nearest_node_that_lacked_them(swarm):
    config = DHTConfig(request_timeout=1.0, lookup_timeout=5.0, num_replicas=2)
    peers = [swarm.add(config=config) for _ in range(8)]
    reader = swarm.add(config=config, client_mode=True)
    now = get_dht_time()
    key = key_to_bytes("cached")
    assert peers[1].dht.store("cached", 5, now + 60)
    assert peers[1].run(peers[1].dht.node.wait_for_stores(timeout=5))  # the last replicas, written in the background
    stored = {p.peer_id: p.dht.node.storage.get(key) for p in peers if p.dht.node.storage.get(key) is not None}
    assert len(stored) >= 2
    assert reader.dht.node.cache.get(key) is None
    assert reader.dht.get("cached", latest=True).value == 5
    assert reader.dht.node.cache.get(key) == next(iter(stored.values()))  # §2.3: kept for the next get
    holders = set(stored)
    # §2.3: the nearest node that answered without the value gets a copy for later readers
    others = [p for p in peers if p.peer_id not in holders]
    nearest_lacking = min(others, key=lambda p: p.dht.node.node_id ^ int.from_bytes(key, "big"))

    def copied() -> bool:
        return nearest_lacking.dht.node.cache.get(key) is not None

    assert wait_until(copied, timeout=5)
    assert all(p.dht.node.cache.get(key) is None for p in others if p is not nearest_lacking)


def test_a_cached_copy_answers_for_cache_max_age_then_the_key_is_looked_up_again(swarm):
    # Two writers add subkeys to one dictionary; readers that are not its replicas (client mode)
    # keep what they found. A cached copy must not hide the second writer's subkey for the whole
    # life of the first: past cache_max_age the reader asks the network again.
    plan = FaultPlan()
    peers = [swarm.add(config=DHTConfig(request_timeout=1.0, lookup_timeout=2.0)) for _ in range(6)]
    patient = swarm.add(config=DHTConfig(cache_max_age=600.0), client_mode=True)
    eager = swarm.add(config=DHTConfig(request_timeout=1.0, lookup_timeout=2.0, cache_max_age=0.0, fault_plan=plan),
                      client_mode=True)
    now = get_dht_time()
    assert peers[1].dht.store("board", "a1", now + 60, subkey="a")
    assert peers[1].run(peers[1].dht.node.wait_for_stores(timeout=5))
    for reader in (patient, eager):
        assert set(reader.dht.get("board").value) == {"a"}
    assert peers[4].dht.store("board", "b1", now + 60, subkey="b")
    assert peers[4].run(peers[4].dht.node.wait_for_stores(timeout=5))

    finds = patient.dht.node.protocol.calls_sent.get(FIND, 0)
    assert set(patient.dht.get("board").value) == {"a"}  # its own copy answers, within cache_max_age
    assert patient.dht.node.protocol.calls_sent.get(FIND, 0) == finds
    assert set(eager.dht.get("board").value) == {"a", "b"}  # looked up again: the new subkey is seen
    assert set(patient.dht.get("board", latest=True).value) == {"a", "b"}

    for peer in peers:  # nothing left to ask: the cached copy (still unexpired) is the answer
        plan.set_link(eager.peer_id, peer.peer_id, LinkFault(refuse=True))
    found = eager.dht.get("board")
    assert found is not None and {k: v.value for k, v in found.value.items()} == {"a": "a1", "b": "b1"}


@pytest.mark.parametrize("max_age", [600.0, 0.0])
def test_a_node_serves_its_cached_copy_to_others_only_for_cache_max_age(swarm, max_age):
    plan = FaultPlan()
    config = DHTConfig(request_timeout=1.0, lookup_timeout=2.0, num_replicas=2, fault_plan=plan)
    peers = [swarm.add(config=config) for _ in range(5)]
    middle = swarm.add(config=DHTConfig(cache_max_age=max_age, num_replicas=2))

    def distance(peer, name):
        return peer.dht.node.node_id ^ int.from_bytes(key_to_bytes(name), "big")

    # a key the middle node is the farthest from, so it holds the record only as a cached copy
    name = next(n for n in (f"popular-{i}" for i in range(1000)) if distance(middle, n) > max(
        distance(p, n) for p in peers))
    assert peers[0].dht.store(name, 7, get_dht_time() + 60)
    assert peers[0].run(peers[0].dht.node.wait_for_stores(timeout=5))
    assert middle.dht.node.storage.get(key_to_bytes(name)) is None
    assert middle.dht.get(name, latest=True).value == 7  # now cached there
    reader = swarm.add(config=config, client_mode=True, initial=middle.addrs)
    for peer in peers:  # the reader can reach nobody but the middle node
        plan.set_link(reader.peer_id, peer.peer_id, LinkFault(refuse=True))
    found = reader.dht.get(name)
    assert (found.value if found is not None else None) == (7 if max_age else None)


def test_bad_arguments_fail_clearly(swarm):
    (a,) = swarm.grow(1)
    now = get_dht_time()
    with pytest.raises(TypeError, match="str or bytes"):
        a.dht.store(5, 1, now + 60)
    with pytest.raises(TypeError, match="msgpack"):
        a.dht.store("k", object(), now + 60)
    with pytest.raises(TypeError, match="subkey"):
        a.dht.store("k", 1, now + 60, subkey=1.5)
    with pytest.raises(ValueError, match="finite"):
        a.dht.store("k", 1, float("nan"))
    with pytest.raises(ValueError, match="limit"):
        a.dht.store("k", b"x" * (2 << 20), now + 60)


# --- validators across the network --------------------------------------------------------------


def test_owner_records_are_writable_only_by_their_owner(swarm):
    peers = swarm.grow(6)
    alice, mallory, reader = peers[1], peers[2], peers[5]
    now = get_dht_time()
    key = "alice_status" + owner_marker(alice.peer_id)
    assert alice.dht.store(key, "online", now + 60)
    with pytest.raises(ValidationError, match="carries no signature"):
        mallory.dht.store(key, "hacked", now + 120)
    assert reader.dht.get(key, latest=True) == ("online", now + 60)  # signature stripped
    # subkeys can be owned too: a shared dictionary where everyone writes only their own entry
    assert alice.dht.store("roster", "alice", now + 60, subkey=owner_marker(alice.peer_id))
    assert mallory.dht.store("roster", "mallory", now + 60, subkey=owner_marker(mallory.peer_id))
    with pytest.raises(ValidationError):
        mallory.dht.store("roster", "fake", now + 90, subkey=owner_marker(alice.peer_id))
    roster = reader.dht.get("roster", latest=True).value
    assert {v.value for v in roster.values()} == {"alice", "mallory"}


class Progress(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    step: int
    loss: float


def test_schema_refusals_come_back_with_their_reason(swarm):
    schema = SchemaValidator({"progress": Progress, "peers": dict[str, int]}, prefix="run1_")
    strict = DHTConfig(request_timeout=1.0, lookup_timeout=5.0, validators=(schema,))
    peers = [swarm.add(config=strict) for _ in range(5)]
    outdated = swarm.add(config=FAST)  # a node that does not know the schema
    now = get_dht_time()
    assert peers[1].dht.store("run1_progress", {"step": 1, "loss": 0.5}, now + 60)
    assert peers[2].dht.store("run1_peers", 3, now + 60, subkey="p")
    with pytest.raises(ValidationError, match="violates the schema"):
        peers[1].dht.store("run1_progress", {"step": "one"}, now + 60)  # refused locally
    with pytest.raises(ValidationError, match=r"refused: .*violates the schema"):
        outdated.dht.store("run1_progress", {"step": "two", "loss": 1.0}, now + 90)  # refused by the others
    with pytest.raises(ValidationError, match="not in the schema"):
        outdated.dht.store("run1_unknown", 1, now + 60)
    assert peers[3].dht.get("run1_progress", latest=True).value == {"step": 1, "loss": 0.5}
    assert outdated.dht.store("other_key", 1, now + 60)  # keys outside the prefix are free


# --- upkeep ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_writer_republishes_its_records_after_their_replicas_die(swarm):
    config = DHTConfig(request_timeout=1.0, lookup_timeout=5.0, republish_interval=0.5, num_replicas=2)
    peers = [swarm.add(config=config) for _ in range(10)]
    writer = swarm.add(config=config, client_mode=True)  # keeps no replica itself
    now = get_dht_time()
    key = key_to_bytes("precious")
    assert writer.dht.store("precious", "keep me", now + 120)
    assert writer.run(writer.dht.node.wait_for_stores(timeout=5))  # the last replica, written in the background
    holders = [p for p in peers if p.dht.node.storage.get(key) is not None]
    assert len(holders) == 2
    for holder in holders:
        if holder is not peers[0]:  # peers[0] owns the shared event loop
            swarm.kill(holder)
    others = [p for p in peers if p not in holders]

    def replicated_again() -> bool:
        return sum(p.dht.node.storage.get(key) is not None for p in others) >= 1

    assert wait_until(replicated_again, timeout=20)
    assert others[-1].dht.get("precious", latest=True).value == "keep me"


def test_refresh_looks_up_stale_buckets(swarm):
    peers = swarm.grow(6)
    node = peers[3].dht.node
    for bucket in node.routing_table.buckets:
        bucket.last_updated = 0.0
    before = node.stats.lookups
    peers[3].run(node.refresh())
    assert node.stats.lookups > before
    assert all(time.time() - b.last_updated < 60 for b in node.routing_table.buckets if len(b))


# --- joining, client mode and faults ------------------------------------------------------------


def test_client_mode_peer_uses_the_dht_but_stays_out_of_routing_tables(swarm):
    peers = swarm.grow(6)
    client = swarm.add(client_mode=True)
    now = get_dht_time()
    assert client.server is None and client.dht.node.client_mode
    assert client.dht.store("from-client", 1, now + 60)
    assert peers[3].dht.get("from-client").value == 1
    assert peers[2].dht.store("for-client", 2, now + 60)
    assert client.dht.get("for-client", latest=True).value == 2
    assert len(client.dht.node.storage) == 0  # it keeps no records for others
    for peer in peers:
        assert peer.dht.node.routing_table.get(peer_id=client.peer_id) is None


def test_joining_works_while_some_initial_peers_are_down(swarm):
    a, b = swarm.grow(2)
    bare = str(Multiaddr.parse(b.addrs[0]).with_peer_id(None))  # an address without a PeerID
    joined = swarm.add(initial=[dead_addr(), bare, dead_addr()])
    assert joined.dht.node.routing_table.get(peer_id=b.peer_id) is not None
    assert joined.dht.node.routing_table.get(peer_id=a.peer_id) is not None  # found by the self-lookup
    assert joined.dht.store("joined", 1, get_dht_time() + 60)


def test_joining_fails_clearly_when_no_initial_peer_answers(swarm):
    swarm.grow(1)
    dead = [dead_addr(), dead_addr()]
    start = time.monotonic()
    with pytest.raises(DHTError, match="none of the 2 initial peers answered") as error:
        swarm.add(initial=dead)
    assert time.monotonic() - start < 5
    assert dead[0] in str(error.value) and "Connection refused" in str(error.value)


@pytest.mark.timeout(90)
def test_a_joins_first_ping_that_is_lost_is_sent_again_without_waiting_out_its_timeout(swarm):
    holder = swarm.add()
    plan = FaultPlan()
    plan.set_peer(holder.peer_id, LinkFault(lose_first=1))  # the newcomer's first request to it is lost
    config = DHTConfig(request_timeout=30.0, min_request_timeout=30.0, lookup_timeout=30.0, fault_plan=plan)
    start = time.monotonic()
    newcomer = swarm.add(config=config)
    # before, the join's ping waited its whole 30 s timeout before the second attempt
    assert time.monotonic() - start < config.request_timeout
    assert plan.stats.lost == 1
    assert newcomer.dht.node.protocol.calls_sent[PING] >= 2
    assert newcomer.dht.node.routing_table.get(peer_id=holder.peer_id) is not None


@pytest.mark.timeout(60)
def test_gets_finish_within_their_deadline_when_links_are_lossy_or_dead(swarm):
    plan = FaultPlan(seed=1)
    config = DHTConfig(request_timeout=0.5, lookup_timeout=3.0, fault_plan=plan, num_replicas=4)
    peers = [swarm.add(config=config) for _ in range(10)]
    reader = swarm.add(config=config, client_mode=True)  # holds no replica: every key crosses the links
    now = get_dht_time()
    keys = [f"lossy{i}" for i in range(20)]
    assert all(peers[1].dht.store_many(keys, list(range(20)), now + 60))
    assert peers[1].run(peers[1].dht.node.wait_for_stores(timeout=5))  # every replica written before the faults
    for peer in peers[2:5]:
        plan.set_peer(peer.peer_id, LinkFault(loss=1.0))  # black holes: every request to them times out
    plan.default = LinkFault(delay=0.002, jitter=0.005, loss=0.1)
    reader.dht.node.cache.__init__(max_size=10)
    start = time.monotonic()
    found = reader.dht.get_many(keys)
    assert time.monotonic() - start < config.lookup_timeout + 1
    # every get ends by its deadline, and the values are found: a request the lossy link ate is
    # sent once more to a node that was answering (20 of 20 in 20 repeated runs; before that
    # second request, 2-6 of 20 came back empty), while each black hole costs one timeout
    assert sum(v is not None for v in found.values()) >= 18
    assert plan.stats.lost > 0


def test_a_lost_find_request_is_sent_once_more_to_a_node_that_was_answering(swarm):
    plan = FaultPlan()
    config = DHTConfig(request_timeout=0.3, lookup_timeout=3.0, fault_plan=plan, cache_size=0)
    holder = swarm.add(config=config)
    reader = swarm.add(config=config, client_mode=True)
    assert holder.dht.store("only here", "v", get_dht_time() + 60)  # the one node holds the one replica
    plan.set_link(reader.peer_id, holder.peer_id, LinkFault(lose_first=1))
    sent = reader.dht.node.protocol.calls_sent[FIND]
    assert reader.dht.get("only here").value == "v"  # without a second try the only holder is gone
    assert plan.stats.lost == 1
    assert reader.dht.node.protocol.calls_sent[FIND] - sent == 2
    assert reader.dht.node.routing_table.get(peer_id=holder.peer_id) is not None


def test_a_node_that_keeps_timing_out_is_asked_once_per_request(swarm):
    plan = FaultPlan()
    config = DHTConfig(request_timeout=0.5, lookup_timeout=3.0, fault_plan=plan, cache_size=0)
    holder = swarm.add(config=config)
    reader = swarm.add(config=config, client_mode=True)
    assert holder.dht.store("behind a hole", "v", get_dht_time() + 60)
    plan.set_link(reader.peer_id, holder.peer_id, LinkFault(loss=1.0))
    protocol = reader.dht.node.protocol
    sent = protocol.calls_sent[FIND]
    start = time.monotonic()
    assert reader.dht.get("behind a hole") is None
    assert protocol.calls_sent[FIND] - sent == 2  # it had answered until now: asked once more
    assert time.monotonic() - start < 2 * config.request_timeout  # within the first request's deadline
    sent = protocol.calls_sent[FIND]
    assert reader.dht.get("behind a hole") is None
    assert protocol.calls_sent[FIND] - sent == 1  # it timed out before: asked once


def test_large_values_travel_in_batches_under_the_message_limit(swarm):
    peers = swarm.grow(4)
    client = swarm.add(client_mode=True, config=DHTConfig(request_timeout=2.0, cache_size=0))
    now = get_dht_time()
    keys = [f"big{i}" for i in range(12)]
    values = [bytes([i]) * (900 << 10) for i in range(12)]  # ~10.5 MB in all, over the 8 MiB message cap
    assert client.dht.store_many(keys, values, now + 60) == [True] * 12
    found = client.dht.get_many(keys)
    assert all(found[k].value == v for k, v in zip(keys, values))
    assert peers[2].dht.get("big5").value == values[5]


@pytest.mark.timeout(60)
def test_a_black_holed_replica_costs_a_writer_its_request_timeout_once_not_on_every_store_and_get(swarm):
    """A crashed node stays in the others' routing tables for minutes, and every store
    settled by it (the nearest replica) and every fresh get waited out its whole request timeout
    again. Once a request to it timed out, this peer still asks it, but no longer waits for it."""
    plan = FaultPlan()
    config = DHTConfig(request_timeout=4.0, min_request_timeout=4.0, lookup_timeout=30.0, fault_plan=plan)
    peers = [swarm.add(config=config) for _ in range(6)]
    writer, hole = peers[1], peers[4]

    def nearest_is_hole(name: str) -> bool:
        key = int.from_bytes(key_to_bytes(name), "big")
        return min(peers, key=lambda p: p.dht.node.node_id ^ key) is hole

    names = [n for n in (f"near-the-hole-{i}" for i in range(2000)) if nearest_is_hole(n)][:3]
    assert len(names) == 3
    plan.set_peer(hole.peer_id, LinkFault(loss=1.0))  # it crashed: every request to it times out
    now = get_dht_time()
    assert writer.dht.store(names[0], 0, now + 60)  # the first store waits for it once
    assert writer.dht.node.protocol.contacts.is_suspect(hole.peer_id)
    for i, name in enumerate(names[1:], start=1):
        lost = plan.stats.lost
        start = time.monotonic()
        assert writer.dht.store(name, i, now + 60)
        found = writer.dht.get(name, latest=True)
        took = time.monotonic() - start
        assert found is not None and found.value == i
        assert plan.stats.lost > lost  # the suspect was asked all the same
        assert took < config.request_timeout  # but not waited for: before, each store and get waited 4 s
