"""What the attack tests share: raw DHT stores sent as a hostile caller would, bypassing the
client-side checks of `swarm.dht.DHT`, and expert servers as real processes."""

from __future__ import annotations

from typing import Any

from procs import PeerProcess

from swarm.dht.keys import hash_serialized_key, serialize_key, serialize_subkey
from swarm.dht.routing import DHTID, NodeInfo
from swarm.dht.validation import DHTRecord
from swarm.dht.wire import StoreResult, node_id_of, store_item
from swarm.peer import Peer

HID = 8


def serve(pattern: str, *extra: str) -> PeerProcess:
    """A `swarm-peer --experts PATTERN` process on loopback (small ffn experts)."""
    return PeerProcess(
        "--listen", "/ip4/127.0.0.1/tcp/0", "--experts", pattern, "--expert-cls", "ffn",
        "--hidden-dim", str(HID), "--log-level", "WARNING", *extra, ready_timeout=60,
    )


def raw_record(key: str, value: bytes, expiration_time: float, subkey: Any = None) -> DHTRecord:
    """A record with `value` sent as is (no signature, no msgpack): what a hostile writer can send."""
    raw_key = serialize_key(key)
    return DHTRecord(hash_serialized_key(raw_key), serialize_subkey(subkey), value, expiration_time, raw_key)


def nodes_for(attacker: Peer, key: str, count: int = 5) -> list[NodeInfo]:
    """The nodes nearest to `key`, as the attacker's lookup finds them."""
    key_id = DHTID.from_key(key)
    return attacker.run(attacker.dht.node.find_nearest_nodes([key_id], beam_size=count))[key_id][:count]


def store_raw(attacker: Peer, records: list[DHTRecord], nodes: list[NodeInfo]) -> list[list[StoreResult]]:
    """Sends `records` to each node in `nodes` (one Store call per node and record); the answers."""
    protocol = attacker.dht.node.protocol
    answers = []
    for node in nodes:
        results = []
        for record in records:
            found = attacker.run(protocol.call_store(node, [store_item(record)]), timeout=30)
            assert found is not None, f"{node.peer_id} did not answer"
            results.extend(found)
        answers.append(results)
    return answers


def node_of(addr: str) -> NodeInfo:
    """The DHT node at a full multiaddr (ending in /p2p/<PeerID>)."""
    peer_id = addr.rsplit("/p2p/", 1)[1]
    return NodeInfo(node_id_of(peer_id), peer_id, addr)


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid`."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
