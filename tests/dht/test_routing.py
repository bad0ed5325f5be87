"""Tests for swarm.dht.routing: IDs, XOR distance, k-buckets, splitting, lookups, blacklist."""

from __future__ import annotations

import hashlib
import random
import time

import pytest

from swarm.core.identity import Identity, peer_id_to_bytes
from swarm.dht.blacklist import Blacklist
from swarm.dht.buckets import KBucket, NodeInfo
from swarm.dht.ids import DHTID, ID_BITS, ID_BYTES, xor_distance
from swarm.dht.keys import serialize_key
from swarm.dht.routing import RoutingTable


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_node(node_id: int, name: str | None = None) -> NodeInfo:
    peer = name or f"peer-{node_id:x}"
    return NodeInfo(DHTID(node_id), peer, f"/ip4/127.0.0.1/tcp/1/p2p/{peer}")


def add(table: RoutingTable, node_id: int, name: str | None = None) -> NodeInfo | None:
    node = make_node(node_id, name)
    return table.add_or_update(node.node_id, node.peer_id, node.addr)


def check_invariants(table: RoutingTable) -> None:
    """Buckets tile the ID space, hold only their own range, never exceed k."""
    assert table.buckets[0].lower == 0
    assert table.buckets[-1].upper == DHTID.MAX
    for left, right in zip(table.buckets, table.buckets[1:], strict=False):
        assert left.upper == right.lower
    seen = set()
    for bucket in table.buckets:
        assert len(bucket.nodes) <= table.bucket_size
        assert len(bucket.replacements) <= table.bucket_size
        assert (bucket.upper - bucket.lower) == 1 << (ID_BITS - bucket.depth)
        for node_id in (*bucket.nodes, *bucket.replacements):
            assert bucket.has_in_range(node_id)
        seen.update(bucket.nodes)
    assert seen == {node.node_id for node in table}
    assert len(table) == len(seen)


# --- DHTID -------------------------------------------------------------------------------


def test_dhtid_from_peer_id_is_sha256_of_binary_peer_id() -> None:
    identity = Identity.from_seed(bytes(32))
    expected = int.from_bytes(hashlib.sha256(peer_id_to_bytes(identity.peer_id)).digest(), "big")
    assert DHTID.from_peer_id(identity.peer_id) == expected
    assert isinstance(DHTID.from_peer_id(identity.peer_id), DHTID)


def test_dhtid_from_key_hashes_msgpack_form_so_str_and_bytes_differ() -> None:
    assert DHTID.from_key("abc") == int.from_bytes(hashlib.sha256(serialize_key("abc")).digest(), "big")
    assert DHTID.from_key("abc") != DHTID.from_key(b"abc")
    assert DHTID.from_key("abc") == DHTID.from_key("abc")
    with pytest.raises(TypeError):
        DHTID.from_key(5)  # type: ignore[arg-type]


def test_dhtid_bytes_roundtrip_and_bounds() -> None:
    rng = random.Random(0)
    for value in (0, 1, DHTID.MAX - 1, rng.getrandbits(ID_BITS)):
        node_id = DHTID(value)
        raw = node_id.to_bytes()
        assert len(raw) == ID_BYTES == 32
        assert DHTID.from_bytes(raw) == node_id
        assert isinstance(DHTID.from_bytes(raw), DHTID)
    with pytest.raises(ValueError, match="32 bytes"):
        DHTID.from_bytes(b"\x00" * 31)
    with pytest.raises(ValueError):
        DHTID(-1)
    with pytest.raises(ValueError):
        DHTID(DHTID.MAX)


def test_generate_stays_in_range() -> None:
    rng = random.Random(1)
    for _ in range(100):
        assert 1000 <= DHTID.generate(1000, 1010, rng) < 1010
    with pytest.raises(ValueError):
        DHTID.generate(5, 5)


def test_xor_distance_is_a_metric() -> None:
    rng = random.Random(2)
    for _ in range(200):
        a, b, c = (DHTID.generate(rng=rng) for _ in range(3))
        assert xor_distance(a, a) == 0
        assert xor_distance(a, b) == xor_distance(b, a) == a.xor_distance(b)
        assert xor_distance(a, b) > 0 or a == b
        assert xor_distance(a, c) <= xor_distance(a, b) + xor_distance(b, c)


# --- KBucket -----------------------------------------------------------------------------


def test_kbucket_keeps_least_recently_seen_first_and_caches_overflow() -> None:
    bucket = KBucket(0, DHTID.MAX, size=2, last_updated=0.0)
    a, b, c, d = (make_node(i) for i in (1, 2, 3, 4))
    assert bucket.add_or_update(a, 1.0)
    assert bucket.add_or_update(b, 2.0)
    assert bucket.least_recently_seen() == a
    assert bucket.add_or_update(a, 3.0)  # seen again: moves to the tail
    assert bucket.least_recently_seen() == b
    assert not bucket.add_or_update(c, 4.0)
    assert not bucket.add_or_update(d, 5.0)
    assert list(bucket.replacements) == [3, 4]
    assert not bucket.add_or_update(make_node(5), 6.0)  # cache holds at most k: oldest dropped
    assert list(bucket.replacements) == [4, 5]
    assert bucket.last_updated == 6.0
    assert bucket.remove(DHTID(2)) == make_node(5)  # the freshest cached node is promoted
    assert list(bucket.nodes) == [1, 5]
    assert list(bucket.replacements) == [4]


def test_kbucket_update_takes_new_address() -> None:
    bucket = KBucket(0, DHTID.MAX, size=2, last_updated=0.0)
    bucket.add_or_update(NodeInfo(DHTID(1), "p", "/ip4/1.1.1.1/tcp/1"), 1.0)
    bucket.add_or_update(NodeInfo(DHTID(1), "p", "/ip4/2.2.2.2/tcp/2"), 2.0)
    assert bucket.nodes[DHTID(1)].addr == "/ip4/2.2.2.2/tcp/2"
    assert len(bucket) == 1


# --- RoutingTable ------------------------------------------------------------------------


def test_table_never_holds_itself_and_indexes_by_peer_id() -> None:
    table = RoutingTable(DHTID(0), bucket_size=4)
    assert add(table, 0) is None
    assert len(table) == 0
    add(table, 7, "seven")
    assert DHTID(7) in table and 7 in table and 8 not in table and "seven" not in table
    assert table.get(node_id=7) == make_node(7, "seven")
    assert table.get(peer_id="seven") == make_node(7, "seven")
    assert table.get(peer_id="nobody") is None
    with pytest.raises(TypeError):
        table.get()


def test_peer_id_moving_to_a_new_node_id_keeps_one_entry() -> None:
    table = RoutingTable(DHTID(0), bucket_size=4)
    add(table, 7, "p")
    add(table, 9, "p")
    assert 7 not in table and 9 in table
    assert table.get(peer_id="p").node_id == 9
    assert len(table) == 1


def test_full_bucket_without_own_id_returns_least_recently_seen_to_ping() -> None:
    # §2.2 / §4.2 strict rule (depth_modulo=1): only the bucket holding our own ID splits.
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1)
    half = DHTID.MAX // 2
    assert add(table, half + 1) is None
    assert add(table, half + 2) is None
    to_ping = add(table, half + 3)  # splits [0, MAX) once; [half, MAX) is full and may not split
    assert to_ping == make_node(half + 1)
    assert len(table.buckets) == 2
    assert half + 3 not in table
    # The pinged node did not answer: removing it promotes the waiting node (§4.1).
    assert table.remove(half + 1) == make_node(half + 3)
    assert half + 3 in table and half + 1 not in table
    assert table.get(peer_id=make_node(half + 3).peer_id) is not None
    check_invariants(table)


def test_refreshing_a_full_bucket_node_keeps_it() -> None:
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=1)
    half = DHTID.MAX // 2
    add(table, half + 1)
    add(table, half + 2)
    add(table, half + 1)  # half+1 answered: now most recently seen
    assert add(table, half + 3) == make_node(half + 2)


def test_relaxed_split_rule_splits_until_depth_is_a_multiple_of_depth_modulo() -> None:
    # §4.2: a bucket not holding our ID still splits while depth % b != 0.
    table = RoutingTable(DHTID(0), bucket_size=2, depth_modulo=5)
    prefix = 0b11111 << (ID_BITS - 5)
    rng = random.Random(3)
    ids = [prefix | rng.getrandbits(ID_BITS - 5) for _ in range(3)]
    assert add(table, ids[0]) is None
    assert add(table, ids[1]) is None
    assert add(table, ids[2]) == make_node(ids[0])
    far = table.buckets[-1]
    assert far.depth == 5 and far.lower == prefix
    assert len(table.buckets) == 6  # [0..) split at depths 0-4, plus the depth-5 far bucket
    check_invariants(table)


def test_own_bucket_keeps_splitting_so_close_nodes_are_kept() -> None:
    own = DHTID.generate(rng=random.Random(4))
    table = RoutingTable(own, bucket_size=2, depth_modulo=1)
    close = [own ^ (1 << bit) for bit in range(40)]  # one node at each distance 2**bit
    assert all(add(table, node_id) is None for node_id in close)
    assert len(table) == 40
    check_invariants(table)


def test_many_nodes_keep_invariants_and_nearest_neighbors_match_brute_force() -> None:
    rng = random.Random(5)
    own = DHTID.generate(rng=rng)
    table = RoutingTable(own, bucket_size=20, depth_modulo=5)
    all_ids = [DHTID.generate(rng=rng) for _ in range(3000)]
    for node_id in all_ids:
        add(table, node_id)
    check_invariants(table)
    assert len(table) >= 200
    nodes = list(table)
    started = time.perf_counter()
    for _ in range(100):
        query = DHTID.generate(rng=rng)
        expected = sorted(nodes, key=lambda n: n.node_id ^ query)[:20]
        assert table.get_nearest_neighbors(query, 20) == expected
    assert time.perf_counter() - started < 5.0
    query = nodes[0].node_id
    found = table.get_nearest_neighbors(query, 5, exclude=query)
    assert query not in {n.node_id for n in found} and len(found) == 5
    found = table.get_nearest_neighbors(query, 5, exclude=[n.node_id for n in nodes[:3]])
    assert not {n.node_id for n in found} & {n.node_id for n in nodes[:3]}
    assert table.get_nearest_neighbors(query, 0) == []
    assert len(table.get_nearest_neighbors(query, 10**6)) == len(table)


def test_nearest_neighbors_of_1000_node_table_is_fast() -> None:
    rng = random.Random(6)
    table = RoutingTable(DHTID(0), bucket_size=1000)  # one bucket: all 1000 nodes kept
    for _ in range(1000):
        add(table, DHTID.generate(rng=rng))
    assert len(table) == 1000
    started = time.perf_counter()
    for _ in range(200):
        table.get_nearest_neighbors(DHTID.generate(rng=rng), 20)
    assert (time.perf_counter() - started) / 200 < 0.01


def test_buckets_to_refresh_names_ids_in_stale_buckets() -> None:
    clock = FakeClock(1000.0)
    table = RoutingTable(DHTID(0), bucket_size=1, depth_modulo=1, clock=clock)
    half = DHTID.MAX // 2
    add(table, 5)  # bucket [0, MAX)
    clock.now = 1100.0
    add(table, half + 5)  # splits: both halves inherit the time of the split, right then touched
    assert len(table.buckets) == 2
    clock.now = 1200.0
    add(table, 5)  # touches the left bucket
    stale = table.buckets_to_refresh(now=1200.0 + 3600.0 - 50, interval=3600.0, rng=random.Random(7))
    assert len(stale) == 1 and half <= stale[0] < DHTID.MAX
    assert len(table.buckets_to_refresh(now=1200.0 + 3600.0, interval=3600.0)) == 2
    assert table.buckets_to_refresh(now=1200.0, interval=3600.0) == []


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RoutingTable(DHTID(0), bucket_size=0)
    with pytest.raises(ValueError):
        RoutingTable(DHTID(0), depth_modulo=0)


# --- Blacklist ---------------------------------------------------------------------------


def test_blacklist_backs_off_exponentially_and_success_clears() -> None:
    clock = FakeClock(0.0)
    blacklist = Blacklist(base_time=5.0, backoff_rate=2.0, clock=clock)
    assert not blacklist.is_banned("p")
    blacklist.register_failure("p")
    assert blacklist.is_banned("p") and "p" in blacklist and len(blacklist) == 1
    assert blacklist.banned_until("p") == 5.0
    clock.now = 4.9
    blacklist.register_failure("p")  # still banned: the same outage, not a second failure
    assert blacklist.banned_until("p") == 5.0
    clock.now = 5.0
    assert not blacklist.is_banned("p") and len(blacklist) == 0
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == 15.0  # 5 * 2
    clock.now = 15.0
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == 35.0  # 5 * 4
    blacklist.register_success("p")
    assert not blacklist.is_banned("p")
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == 20.0  # back to base_time


def test_blacklist_ban_is_capped() -> None:
    clock = FakeClock(0.0)
    blacklist = Blacklist(base_time=1.0, backoff_rate=1e6, max_time=60.0, clock=clock)
    for _ in range(200):
        blacklist.register_failure("p")
        clock.now = blacklist.banned_until("p") or clock.now
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == clock.now + 60.0
    with pytest.raises(ValueError):
        Blacklist(base_time=0)


def test_blacklist_forgets_peers_quiet_for_max_time() -> None:
    clock = FakeClock(0.0)
    blacklist = Blacklist(base_time=1.0, backoff_rate=2.0, max_time=10.0, clock=clock)
    blacklist.register_failure("p")
    clock.now = 1.0
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == 3.0
    clock.now = 13.5  # more than max_time after the ban ended
    blacklist.register_failure("p")
    assert blacklist.banned_until("p") == 14.5
