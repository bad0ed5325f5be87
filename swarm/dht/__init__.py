"""swarm's Kademlia DHT (docs/architecture.md, layer dht): `peer.dht` is a `DHT`.

One concept per module: `keys` (how user keys become DHT keys), `ids` (node and key IDs, XOR
distance), `buckets` (k-buckets and their nodes), `blacklist` (bans with backoff), `routing` (the
routing table), `expiring` (values with expiration), `dictionary_value` (subkeys), `storage` (a
node's records and cache), `validation` (owner signatures), `schema` (pydantic schemas, imported
on first use so that peers without one never load pydantic), `wire` (what travels: method paths,
statuses, answers), `handlers` (the Ping/Store/Find/Leave handlers), `protocol` (the calls to
other nodes), `contacts` (the routing table kept in step with the traffic, and goodbyes),
`traversal` (the iterative lookup), `batching` (records packed into requests), `store_operation`
and `store_outcome` (one store and what became of each record), `replication` (stores),
`retrieval` (gets and caching), `handoff` (records handed to new nodes), `node` (joining, upkeep
and leaving), `coalescer` (bursts of single calls into batches), `dht` (the user-facing facade),
`config`, and `faults` (link faults for tests and simulations).
"""

from typing import Any

from swarm.core.faults import FaultPlan, LinkFault
from swarm.dht.config import DHTConfig
from swarm.dht.dht import DHT
from swarm.dht.expiring import ValueWithExpiration, subkey_entries
from swarm.dht.node import DHTNode
from swarm.dht.validation import (
    CompositeValidator,
    RecordValidator,
    SignatureValidator,
    marker_owner,
    owner_marker,
)

__all__ = [
    "DHT",
    "CompositeValidator",
    "DHTConfig",
    "DHTNode",
    "FaultPlan",
    "LinkFault",
    "RecordValidator",
    "SchemaValidator",
    "SignatureValidator",
    "ValueWithExpiration",
    "marker_owner",
    "owner_marker",
    "subkey_entries",
]


def __getattr__(name: str) -> Any:
    if name == "SchemaValidator":
        from swarm.dht.schema import SchemaValidator

        return SchemaValidator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
