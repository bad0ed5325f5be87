"""What travels between DHT nodes (proto/dht.proto): method paths, limits, statuses, and the forms
in which answers reach the rest of the DHT.

Both sides of the protocol share these: the callee's handlers (`handlers.py`) and the caller's
`call_*` (`protocol.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from swarm.dht.buckets import NodeInfo
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.ids import DHTID
from swarm.dht.validation import DHTRecord
from swarm.proto import dht_pb2

if TYPE_CHECKING:
    import grpc

PING = "/swarm.DHT/Ping"
STORE = "/swarm.DHT/Store"
FIND = "/swarm.DHT/Find"
LEAVE = "/swarm.DHT/Leave"

MAX_ITEMS_PER_REQUEST = 4096
"""Most keys or records one request may carry."""
MAX_RAW_KEY_BYTES = 4096
MAX_SUBKEY_BYTES = 4096
CACHE_LIMIT = 65536
"""Entries of the small parse caches on both sides before they are cleared."""

STORED = dht_pb2.DHT_STORED
OUTDATED = dht_pb2.DHT_OUTDATED
INVALID = dht_pb2.DHT_INVALID
REFUSED = dht_pb2.DHT_REFUSED


class StoreResult(NamedTuple):
    """A callee's answer for one record.

    Attributes:
        status: STORED, OUTDATED, INVALID or REFUSED.
        reason: Why it was not stored (empty if stored).
        nearest: The nodes the callee knows nearest to the record's key, if they were asked for.
    """

    status: int
    reason: str = ""
    nearest: list[NodeInfo] = []  # noqa: RUF012 - a NamedTuple default, never mutated


class FindAnswer(NamedTuple):
    """A callee's answer for one key.

    Attributes:
        value: The value it holds (bytes, or a `DictionaryValue`), or None.
        nearest: The nodes it knows nearest to the key (empty if it returned the value and the
            request said values suffice).
        omitted: It held back the value to keep its answer small: ask it again.
    """

    value: ValueWithExpiration | None
    nearest: list[NodeInfo]
    omitted: bool = False


def node_id_of(peer_id: str, _cache: dict[str, DHTID] = {}) -> DHTID:  # noqa: B006 - a deliberate memo
    """The DHT node ID of a PeerID (memoized: it costs a base58 decode and a sha256)."""
    node_id = _cache.get(peer_id)
    if node_id is None:
        if len(_cache) > CACHE_LIMIT:
            _cache.clear()
        node_id = _cache[peer_id] = DHTID.from_peer_id(peer_id)
    return node_id


def store_item(record: DHTRecord, in_cache: bool = False) -> dht_pb2.DHTStoreItem:
    """The wire form of a record (its original key must be known)."""
    if record.raw_key is None:
        raise ValueError("a record is sent with its original key (raw_key)")
    return dht_pb2.DHTStoreItem(
        raw_key=record.raw_key, subkey=record.subkey, value=record.value,
        expiration_time=record.expiration_time, in_cache=in_cache,
    )


def bare(addr: str) -> str:
    """A multiaddr without its /p2p/<PeerID> part (the form addresses travel in)."""
    if addr.endswith("/p2p-circuit"):  # a relayed address, already bare (docs/relay.md)
        return addr
    cut = addr.rfind("/p2p/")  # the last: a relayed address names its relay with /p2p/ too
    return addr if cut < 0 else addr[:cut]


def observed_host(grpc_context: grpc.aio.ServicerContext | None) -> str | None:
    """The caller's IP as the transport saw it ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    if grpc_context is None:  # a call over the bulk side channel
        return None
    try:
        peer = grpc_context.peer()
    except Exception:  # noqa: BLE001 - only a hint
        return None
    if not isinstance(peer, str):
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]").split("%")[0]
    return None
