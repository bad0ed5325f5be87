"""Averaging and state transfer with peers behind relays, on loopback (docs/relay.md): two peers
that say they are private, reached only through their relays, average exactly with two public
ones, and a private peer hands its state to a newcomer."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm.averaging import Averager, State, StateServer, load_state_from_peers
from swarm.averaging.election import DHTElection, StaticElection
from swarm.averaging.group import MemberInfo, cap_relayed_parts
from swarm.core.identity import Identity
from swarm.core.multiaddr import Multiaddr, is_relayed
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig
from swarm.dht.ids import DHTID
from swarm.dht.keys import key_to_bytes
from swarm.dht.wire import node_id_of
from swarm.net.nat import NatConfig
from swarm.net.relay import ReservationsConfig

PRIVATE = NatConfig(reachability="private", reservations=ReservationsConfig(target=1))


def steps(averagers: list[Averager], timeout: float) -> list[object]:
    out: list[object] = [None] * len(averagers)

    def run(i: int) -> None:
        try:
            out[i] = averagers[i].step(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


@pytest.mark.timeout(90)
def test_two_relayed_and_two_public_peers_average_exactly(make_peer):
    a = make_peer()
    b = make_peer(initial_peers=a.addrs)
    c = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    d = make_peer(initial_peers=b.addrs, nat=PRIVATE)
    group = [a, b, c, d]
    assert all(Multiaddr.parse(p.addrs[0]).relay_id for p in (c, d))
    inputs = [torch.randn(50_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    tensors = [[x.clone()] for x in inputs]
    addrs = [p.addrs[0] for p in group]
    averagers = [Averager(p, t, prefix="relayed", target_group_size=4, initial_group=addrs)
                 for p, t in zip(group, tensors, strict=True)]
    results = steps(averagers, timeout=30)
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(r.group[0] in (a.peer_id, b.peer_id) for r in results)  # a direct peer leads
    exact = sum(inputs) / 4
    for t in tensors:
        assert float((t[0] - exact).abs().max()) <= 1e-5
    assert all(torch.equal(tensors[0][0], t[0]) for t in tensors)
    relayed = sum(p.nat.relay.spliced_bytes for p in (a, b) if p.nat.relay is not None)
    # the private peers are reached through their relays: each relayed reducer's part (5,000 of the
    # 50,000 values: it declares a quarter of the bandwidth) comes in from three peers and goes back
    assert relayed >= 2 * 2 * 3 * 5_000 * 4


@pytest.mark.timeout(60)
def test_a_relayed_peer_hands_its_state_to_a_newcomer(make_peer):
    a = make_peer()
    c = make_peer(initial_peers=a.addrs, nat=PRIVATE)
    big = torch.randn(300_000)
    StateServer(c, "s", lambda: State({"step": 7}, [big, torch.ones(3)]), chunk_bytes=1 << 16)
    newcomer = make_peer(client_mode=True)
    got = load_state_from_peers(newcomer, "s", [c.addrs[0]], timeout=20)
    assert got.metadata == {"step": 7} and got.sources == [c.peer_id]
    assert torch.equal(got.tensors[0], big) and torch.equal(got.tensors[1], torch.ones(3))


def test_a_relayed_peer_declares_a_share_of_its_bandwidth_so_direct_reducers_take_most_of_the_parts():
    from swarm.averaging.averager import RELAYED_BANDWIDTH, declared_bandwidth
    from swarm.averaging.partition import part_sizes

    relay_id, peer_id = Identity.generate().peer_id, Identity.generate().peer_id
    relayed = f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}"
    assert declared_bandwidth([relayed], 2.0) == 2.0 * RELAYED_BANDWIDTH
    assert declared_bandwidth([f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}"], 2.0) == 2.0
    sizes = part_sizes(1000, [declared_bandwidth(a, 1.0) for a in ([relayed], ["/ip4/10.0.0.2/tcp/1"])])
    assert sizes == [200, 800]


@pytest.mark.timeout(60)
def test_a_record_whose_nearest_node_is_relayed_is_also_stored_on_a_direct_node(make_peer):
    config = DHTConfig(request_timeout=5.0, lookup_timeout=15.0, num_replicas=1)  # the relayed path, on a loaded host
    a = make_peer(dht_config=config)
    b = make_peer(initial_peers=a.addrs, nat=PRIVATE, dht_config=config)
    writer = make_peer(initial_peers=a.addrs, client_mode=True, dht_config=config)
    a_id, b_id = node_id_of(a.peer_id), node_id_of(b.peer_id)

    def key_id(name: str) -> DHTID:
        return DHTID.from_key(name)  # the ID a store of `name` uses (from_key hashes the key itself)

    assert int(key_id("k")) == int.from_bytes(key_to_bytes("k"), "big")  # the storage key is the ID's bytes
    name = next(f"k{i}" for i in range(1000) if key_id(f"k{i}") ^ b_id < key_id(f"k{i}") ^ a_id)
    for _ in range(20):  # the writer learns b, behind its relay, from a (bounded: a few lookups)
        if any(n.peer_id == b.peer_id for n in writer.dht.node.routing_table):
            break
        writer.dht.get(f"warm-up-{_}")
    nearest = writer.dht.node.routing_table.get_nearest_neighbors(key_id(name), 1)
    assert nearest and nearest[0].peer_id == b.peer_id and is_relayed(nearest[0].addr)
    assert writer.dht.store(name, 1, get_dht_time() + 60)
    assert writer.run(writer.dht.node.wait_for_stores(timeout=10))
    holders = {p.peer_id for p in (a, b) if p.dht.node.storage.get(key_to_bytes(name)) is not None}
    assert holders == {a.peer_id, b.peer_id}  # one replica asked for, and a direct one added


def _addresses(relayed_first: bool) -> tuple[str, str]:
    """A relayed address whose PeerID sorts before a direct one's (so PeerID order alone would pick it)."""
    relay_id = Identity.generate().peer_id
    ids = sorted(Identity.generate().peer_id for _ in range(2))
    relayed = f"/ip4/10.0.0.1/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{ids[0]}"
    direct = f"/ip4/10.0.0.2/tcp/4001/p2p/{ids[1]}"
    return relayed, direct


def test_a_relayed_reducer_never_gets_a_larger_part_than_a_direct_one():
    relayed, direct = _addresses(True)
    leader = MemberInfo(Multiaddr.parse(direct).peer_id or "", direct, bandwidth=1.0)
    fast_relayed = MemberInfo(Multiaddr.parse(relayed).peer_id or "", relayed, bandwidth=8.0)  # declared 4x a quarter
    client = MemberInfo(Identity.generate().peer_id, "", bandwidth=5.0, client_mode=True)
    capped = cap_relayed_parts((leader, fast_relayed, client))
    assert [m.bandwidth for m in capped] == [1.0, 1.0, 5.0] and capped[0] is leader
    only_relayed = (fast_relayed, MemberInfo(Identity.generate().peer_id, "", client_mode=True))
    assert cap_relayed_parts(only_relayed) == only_relayed  # nobody direct: as declared


def test_a_direct_peer_leads_when_there_is_one():
    import asyncio

    relayed, direct = _addresses(True)
    relayed_id, direct_id = Multiaddr.parse(relayed).peer_id, Multiaddr.parse(direct).peer_id
    assert relayed_id and direct_id and relayed_id < direct_id
    me = MemberInfo(relayed_id, relayed)
    static = StaticElection([relayed, direct])
    assert asyncio.run(static.leader(me, set())).peer_id == direct_id
    assert asyncio.run(static.leader(me, {direct_id})).peer_id == relayed_id  # the only one left

    class Declarations:
        """Two live declarations; the relayed peer's expires first (it would lead by expiration)."""

        async def aget(self, key: str, latest: bool = False) -> object:
            from swarm.dht import ValueWithExpiration, owner_marker

            now = get_dht_time()
            entries = {owner_marker(pid): ValueWithExpiration({"addr": addr, "ready_at": now}, now + t)
                       for pid, addr, t in ((relayed_id, relayed, 10), (direct_id, direct, 20))}
            return ValueWithExpiration(entries, now + 20)

        async def astore(self, *args: object, **kwargs: object) -> bool:
            return True

    election = DHTElection(Declarations(), "p")  # type: ignore[arg-type]
    assert asyncio.run(election.leader(me, set())).peer_id == direct_id
    assert asyncio.run(election.leader(me, {direct_id})).peer_id == relayed_id
