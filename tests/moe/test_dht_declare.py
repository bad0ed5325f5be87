"""Tests of swarm.moe.dht_declare: the records, reading them back (garbage ignored), the real DHT."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from torch import nn

from swarm.core.identity import Identity
from swarm.core.timeutil import get_dht_time
from swarm.dht import DHTConfig, FaultPlan, LinkFault, ValueWithExpiration
from swarm.dht.ids import DHTID
from swarm.dht.keys import key_to_bytes
from swarm.moe import ExpertServer
from swarm.moe.dht_declare import (
    DHTExpertSource,
    ExpertDeclarer,
    declarations,
    get_experts,
    get_replicas,
    get_successors,
)

pytestmark = pytest.mark.timeout(60)
P = Identity.from_seed(bytes(32)).peer_id
Q = Identity.from_seed(bytes([1]) * 32).peer_id
A = f"/ip4/127.0.0.1/tcp/1/p2p/{P}"
B = f"/ip4/127.0.0.1/tcp/2/p2p/{Q}"
MP, MQ = f"[owner:{P}]", f"[owner:{Q}]"


Record = ValueWithExpiration  # what the DHT's reads return


class DictDHT:
    """A DHT stand-in holding whatever records a test puts in (no networking)."""

    def __init__(self, records: dict[str, Record]) -> None:
        self.records = records

    async def aget(self, key: str, latest: bool = False) -> Record | None:
        return self.records.get(key)

    async def aget_many(self, keys: list[str], latest: bool = False) -> dict[str, Record | None]:
        return {key: self.records.get(key) for key in keys}


def test_declarations_cover_every_prefix_once_and_name_their_owner() -> None:
    records = declarations(["ffn.0.0", "ffn.0.1", "ffn.1.0"], A, P)
    assert sorted(records, key=str) == sorted(
        [
            ("ffn.", f"0{MP}", ["ffn.0.0", A]),
            ("ffn.", f"1{MP}", ["ffn.1.0", A]),
            ("ffn.0.", f"0{MP}", ["ffn.0.0", A]),
            ("ffn.0.", f"1{MP}", ["ffn.0.1", A]),
            ("ffn.1.", f"0{MP}", ["ffn.1.0", A]),
            ("ffn.0.0", MP, A),
            ("ffn.0.1", MP, A),
            ("ffn.1.0", MP, A),
        ],
        key=str,
    )


def test_reading_back_ignores_garbage_expired_and_unowned_entries() -> None:
    later, earlier = get_dht_time() + 60, get_dht_time() - 60
    dht = DictDHT({
        "ffn.": Record({
            f"0{MP}": Record(["ffn.0.3", A], later),
            f"1{MP}": Record(["ffn.2.0", A], later),     # names another coordinate
            f"2{MP}": Record(["ffn.2.0", A], earlier),   # expired
            f"3{MP}": Record("not a pair", later),
            f"4{MP}": Record(["other.4.0", A], later),   # another grid
            f"x{MP}": Record(["ffn.0.0", A], later),     # subkey is not a coordinate
            f"5{MP}": Record([5, A], later),
            6: Record(["ffn.6.0", A], later),            # names no owner (an unsigned write)
            f"7{MQ}": Record(["ffn.7.0", A], later),     # the address is not the owner's
            f"8{MP}": Record(["ffn.8.0", A], later),
            f"8{MQ}": Record(["ffn.8.1", B], later + 1),  # two servers: the later declaration wins
        }, later),
        "ffn.1.": Record("not a dictionary", later),
        "ffn.0.3": Record({MP: Record(A, later)}, later),
        "ffn.0.4": Record({MP: Record(["not", "an address"], later)}, later),
        "ffn.0.5": Record({MP: Record(A, earlier)}, later),
        "ffn.0.6": Record(A, later),                     # a plain value: no owner, no signature
        "ffn.0.7": Record({MQ: Record(A, later + 5), MP: Record(A, later)}, later),
    })

    async def main() -> None:
        found = await get_successors(dht, ["ffn.", "ffn.1.", "ffn.7.", "not a prefix"])
        assert found == {"ffn.": {0: ("ffn.0.3", A), 8: ("ffn.8.1", B)}, "ffn.1.": {}, "ffn.7.": {}}
        assert await get_experts(
            dht, ["ffn.0.3", "ffn.0.4", "ffn.0.5", "ffn.0.6", "ffn.0.7", "bad uid"]
        ) == {"ffn.0.3": A, "ffn.0.7": A}

    asyncio.run(main())


def test_every_live_server_of_an_expert_is_read_the_newest_first() -> None:
    later = get_dht_time() + 60
    dht = DictDHT({
        "ffn.0.1": Record({MP: Record(A, later), MQ: Record(B, later + 5)}, later),
        "ffn.0.2": Record({MP: Record(A, later), MQ: Record(A, later + 5)}, later),  # Q cannot claim P's address
    })

    async def main() -> None:
        assert await get_replicas(dht, ["ffn.0.1", "ffn.0.2", "ffn.0.3"]) == {"ffn.0.1": [B, A], "ffn.0.2": [A]}
        assert await DHTExpertSource(dht).get_replicas(["ffn.0.1"]) == {"ffn.0.1": [B, A]}  # type: ignore[arg-type]
        assert await get_experts(dht, ["ffn.0.1"]) == {"ffn.0.1": B}

    asyncio.run(main())


def test_servers_declare_and_clients_find_them_through_the_dht(make_peer) -> None:
    first = make_peer()
    second = make_peer(initial_peers=first.addrs)
    ExpertServer(first, {"ffn.0.0": nn.Linear(4, 4), "ffn.0.1": nn.Linear(4, 4)})
    ExpertServer(second, {"ffn.3.2": nn.Linear(4, 4)})
    client = make_peer(initial_peers=first.addrs, client_mode=True)
    source = DHTExpertSource(client.dht)

    async def main() -> tuple[Any, Any]:
        return (
            await source.get_successors(["ffn.", "ffn.0.", "ffn.3."]),
            await source.get_experts(["ffn.0.1", "ffn.3.2", "ffn.9.9"]),
        )

    successors, experts = client.run(main(), timeout=20)
    assert successors == {
        "ffn.": {0: ("ffn.0.0", first.addrs[0]), 3: ("ffn.3.2", second.addrs[0])},
        "ffn.0.": {0: ("ffn.0.0", first.addrs[0]), 1: ("ffn.0.1", first.addrs[0])},
        "ffn.3.": {2: ("ffn.3.2", second.addrs[0])},
    }
    assert experts == {"ffn.0.1": first.addrs[0], "ffn.3.2": second.addrs[0]}
    record = client.dht.get("ffn.3.2")
    assert record.expiration_time > get_dht_time() + 30  # declared for declare_ttl (60 s)


def test_declarer_reannounces_every_third_of_its_ttl(make_peer) -> None:
    peer = make_peer()
    declarer = ExpertDeclarer(peer.dht, ["ffn.0"], peer.addrs[0], ttl=0.3)

    async def main() -> float:
        await declarer.astart()
        first = (await peer.dht.aget("ffn.0")).expiration_time
        started = time.monotonic()
        await asyncio.wait_for(declarer.wait_rounds(3), 10)
        assert time.monotonic() - started >= 2 * 0.1 * 0.9  # two periods of ttl/3
        renewed = (await peer.dht.aget("ffn.0", latest=True)).expiration_time
        await declarer.aclose()
        return renewed - first

    assert peer.run(main(), timeout=20) > 0
    with pytest.raises(ValueError, match="ttl"):
        ExpertDeclarer(peer.dht, ["ffn.0"], peer.addrs[0], ttl=0)


def test_the_first_declaration_returns_once_every_replica_holds_it(make_peer) -> None:
    # A plain store returns once the nearest replica holds the record. Two servers declaring
    # subkeys of one grid prefix at once could then leave a replica with only one of them for a
    # moment, and a full peer that reads the grid then answers from that replica and caches it.
    plan = FaultPlan()
    config = DHTConfig(fault_plan=plan)
    peers = [make_peer(dht_config=config)]
    peers += [make_peer(initial_peers=peers[0].addrs, dht_config=config) for _ in range(3)]
    writer = make_peer(initial_peers=peers[0].addrs, dht_config=config, client_mode=True)
    keys = [key for key, _, _ in declarations(["ffn.0"], A, P)]
    assert len(peers) <= config.num_replicas  # every peer is a replica of every key
    nearest = {min(peers, key=lambda p: p.dht.node.node_id ^ DHTID.from_key(key)).peer_id for key in keys}
    slow = [p for p in peers if p.peer_id not in nearest]
    assert slow
    for peer in slow:
        plan.set_link(writer.peer_id, peer.peer_id, LinkFault(delay=0.5))
    declarer = ExpertDeclarer(writer.dht, ["ffn.0"], A, ttl=60)

    async def main() -> None:
        await declarer.astart()
        await declarer.aclose()

    writer.run(main(), timeout=20)
    for peer in peers:  # the slow replicas too, though a plain store returns before they are written
        assert all(peer.dht.node.storage.get(key_to_bytes(key)) is not None for key in keys), peer.peer_id
