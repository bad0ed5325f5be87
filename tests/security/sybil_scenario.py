"""Fifty Sybil identities from one address against a victim's routing table and a key's replicas,
run inside a network namespace of its own (`test_sybil_diversity.py` starts it with
`unshare --net`; the addresses exist only there). Prints one JSON line.

The Sybils are real DHT nodes on 10.77.0.1 (one /24) that all join through the victim (10.99.0.1);
six honest nodes join from six other /24s (10.88.N.1). The attacker then grinds a key whose
nearest nodes are all Sybils, and the victim stores a record under it.
"""

from __future__ import annotations

import json

from netns import add_addresses

SYBIL_HOST = "10.77.0.1"
VICTIM_HOST = "10.99.0.1"
HONEST = [f"10.88.{i}.1" for i in range(1, 7)]
SYBILS = 50


def main() -> None:
    add_addresses(SYBIL_HOST, VICTIM_HOST, *HONEST)

    from swarm.core.timeutil import get_dht_time
    from swarm.dht import DHTConfig
    from swarm.dht.diversity import PrefixDiversity
    from swarm.dht.ids import DHTID
    from swarm.dht.keys import hash_serialized_key, serialize_key
    from swarm.net.nat import NatConfig
    from swarm.peer import Peer

    public = NatConfig(reachability="public", relay="off")  # no dial-back rounds: every address is direct
    diverse = DHTConfig(diversity=PrefixDiversity(exempt=()))  # in the namespace every address counts
    peers: list[Peer] = []
    try:
        victim = Peer(listen=f"/ip4/{VICTIM_HOST}/tcp/0", dht_config=diverse, nat=public)
        peers.append(victim)
        sybils = []
        for _ in range(SYBILS):  # the attacker's nodes know no limit
            sybils.append(Peer(listen=f"/ip4/{SYBIL_HOST}/tcp/0", initial_peers=victim.addrs,
                               dht_config=DHTConfig(diversity=None), nat=public))
        peers += sybils
        honest = [Peer(listen=f"/ip4/{host}/tcp/0", initial_peers=victim.addrs, dht_config=diverse, nat=public)
                  for host in HONEST]
        peers += honest
        table = list(victim.dht.node.routing_table)
        in_table = {node.peer_id for node in table}
        sybil_ids = {p.peer_id for p in sybils}
        depths: dict[int, int] = {}
        for node in table:
            if node.peer_id in sybil_ids:
                bits = 256 - (node.node_id ^ victim.dht.node.node_id).bit_length()
                depths[bits] = depths.get(bits, 0) + 1

        # a key whose five nearest nodes of the whole swarm are Sybils (what grinding IDs buys)
        everyone = [*sybils, *honest, victim]
        key = next(name for name in (f"target-{i}" for i in range(10_000))
                   if all(p.peer_id in sybil_ids for p in sorted(
                       everyone, key=lambda p: int(DHTID.from_key(name)) ^ int(p.dht.node.node_id))[:5]))
        stored = victim.dht.store(key, "honest value", get_dht_time() + 300)
        raw = hash_serialized_key(serialize_key(key))
        victim.run(victim.dht.node.wait_for_stores(20), timeout=30)  # every replica answered
        print(json.dumps({
            "sybils_in_table": len(in_table & sybil_ids),
            "sybils_per_depth": max(depths.values(), default=0),
            "honest_in_table": len(in_table & {p.peer_id for p in honest}),
            "refused_for_diversity": victim.dht.node.routing_table.refused_for_diversity,
            "stored": bool(stored),
            "sybil_replicas": sum(p.dht.node.storage.get(raw) is not None for p in sybils),
            "honest_replicas": sum(p.dht.node.storage.get(raw) is not None for p in [*honest, victim]),
        }), flush=True)
    finally:
        for peer in reversed(peers):
            peer.shutdown()


if __name__ == "__main__":
    main()
