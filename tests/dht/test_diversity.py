"""`PrefixDiversity` and the routing table's filter, without sockets."""

from __future__ import annotations

import pytest

from swarm.core.errors import ConfigError
from swarm.dht.diversity import PrefixDiversity
from swarm.dht.ids import DHTID
from swarm.dht.routing import NodeInfo, RoutingTable

OPEN = PrefixDiversity(exempt=())


@pytest.mark.parametrize(("addr", "prefix"), [
    ("/ip4/10.1.2.3/tcp/5/p2p/x", "10.1.2.0/24"),
    ("/ip6/2001:db8::1/tcp/5", "2001:db8::/64"),
    ("/dns4/Example.org/tcp/5", "dns:example.org"),
    ("/ip4/9.9.9.9/tcp/1/p2p/relay/p2p-circuit/p2p/x", "9.9.9.0/24"),  # a relayed node counts as its relay's
    ("garbage", ""),
])
def test_prefix_of_names_the_network(addr: str, prefix: str) -> None:
    assert OPEN.prefix_of(addr) == prefix


def test_loopback_and_private_networks_are_exempt_by_default() -> None:
    assert PrefixDiversity().prefix_of("/ip4/127.0.0.1/tcp/1") == ""
    assert PrefixDiversity().prefix_of("/ip4/192.168.1.2/tcp/1") == ""
    assert PrefixDiversity().prefix_of("/ip4/8.8.8.8/tcp/1") == "8.8.8.0/24"
    with pytest.raises(ConfigError):
        PrefixDiversity(exempt=("nonsense",))


def test_a_table_keeps_few_contacts_per_network_and_admits_others() -> None:
    own = DHTID(0)
    table = RoutingTable(own, bucket_size=20, diversity=PrefixDiversity(per_bucket=2, per_table=5, exempt=()))
    for i in range(200):
        table.add_or_update(DHTID.generate(), f"sybil{i}", "/ip4/1.2.3.4/tcp/1")
    assert len(table) <= 5 and table.refused_for_diversity >= 195
    for i in range(10):
        table.add_or_update(DHTID.generate(), f"honest{i}", f"/ip4/5.6.{i}.1/tcp/1")
        assert table.get(peer_id=f"honest{i}") is not None
    unlimited = RoutingTable(own, bucket_size=20)
    for i in range(200):
        unlimited.add_or_update(DHTID.generate(), f"sybil{i}", "/ip4/1.2.3.4/tcp/1")
    assert len(unlimited) > 20  # without the filter they fill the table


def test_pick_takes_the_nearest_with_a_share_per_network() -> None:
    nodes = [NodeInfo(DHTID(i), f"p{i}", "/ip4/1.2.3.4/tcp/1" if i < 8 else f"/ip4/5.6.{i}.1/tcp/1")
             for i in range(12)]
    chosen = OPEN.pick(nodes, 5)
    assert [n.peer_id for n in chosen] == ["p0", "p1", "p8", "p9", "p10"]
    assert [n.peer_id for n in OPEN.pick(nodes, 5, prior=nodes[:2])] == ["p0", "p1", "p8", "p9", "p10"]
    assert [n.peer_id for n in OPEN.pick(nodes[2:], 3, prior=nodes[:2])] == ["p8", "p9", "p10"]
