"""The callee side of the DHT protocol: the Ping, Store, Find and Leave handlers (proto/dht.proto).

A request adds the caller to the callee's routing table (Kademlia §2.2, `contacts.py`), under the
PeerID the transport authenticated and with the address the request names (trusted for that
PeerID only); a caller in client mode names no address and is never added. A Leave request drops
its caller.

Every record asked to be stored is checked with the node's validators, and each item is answered
with a status and, when refused, the reason, which travels back to the writer.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from swarm.core.errors import InvalidRequest, MultiaddrError, ValidationError
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.dht.buckets import NodeInfo
from swarm.dht.config import DHTConfig
from swarm.dht.contacts import Contacts
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.ids import DHTID
from swarm.dht.keys import deserialize_key
from swarm.dht.routing import RoutingTable
from swarm.dht.storage import CacheStorage, DHTLocalStorage, merge
from swarm.dht.validation import DHTRecord, RecordValidator, record_owner
from swarm.dht.wire import (
    CACHE_LIMIT,
    FIND,
    INVALID,
    LEAVE,
    MAX_ITEMS_PER_REQUEST,
    MAX_RAW_KEY_BYTES,
    MAX_SUBKEY_BYTES,
    OUTDATED,
    PING,
    REFUSED,
    STORE,
    STORED,
    bare,
    node_id_of,
    observed_host,
)
from swarm.net.limits import CallLimit
from swarm.net.server import CallContext, RPCServer
from swarm.proto import dht_pb2

if TYPE_CHECKING:
    from google.protobuf.internal.containers import (
        RepeatedCompositeFieldContainer,
        RepeatedScalarFieldContainer,
    )

_RESPONSE_VALUE_BUDGET = 4 << 20  # bytes of values in one Find answer; past it values are omitted
_ROW_OVERHEAD = 24  # msgpack bytes around one subkey's row, at most


class DHTHandlers:
    """The `rpc_*` handlers of one node.

    Args:
        routing_table: This node's k-buckets (answers name the nodes nearest to keys).
        contacts: Routing-table upkeep (every request teaches about its caller).
        storage: Records this node keeps for the DHT.
        cache: Records cached from lookups, or None.
        validator: Checks every record asked to be stored.
        config: Sizes.
    """

    def __init__(
        self,
        routing_table: RoutingTable,
        contacts: Contacts,
        storage: DHTLocalStorage,
        cache: CacheStorage | None,
        validator: RecordValidator,
        config: DHTConfig,
    ) -> None:
        self.routing_table = routing_table
        self.contacts = contacts
        self.storage = storage
        self.cache = cache
        self.validator = validator
        self.config = config
        self._callers: dict[tuple[str, str | None, tuple[str, ...]], NodeInfo | None] = {}
        self._bare_addrs: dict[str, str] = {}

    def register(self, server: RPCServer) -> None:
        """Serves Ping, Store, Find and Leave on the peer's server."""
        config = self.config
        stores = CallLimit("DHT stores", per_source=config.max_inflight_per_source,
                           rate_per_source=config.source_store_rate)
        finds = CallLimit("DHT finds", per_source=config.max_inflight_per_source, rate_per_source=config.source_find_rate)
        server.add_unary(PING, self.rpc_ping, dht_pb2.DHTPingRequest)
        server.add_unary(STORE, self.rpc_store, dht_pb2.DHTStoreRequest, limit=stores)
        server.add_unary(FIND, self.rpc_find, dht_pb2.DHTFindRequest, limit=finds)
        server.add_unary(LEAVE, self.rpc_leave, dht_pb2.DHTLeaveRequest)

    def _caller_node(self, caller: dht_pb2.DHTCaller, ctx: CallContext) -> NodeInfo | None:
        """The caller as a routing-table entry, or None (client mode, or no usable address)."""
        if not caller.addrs or not ctx.peer_id:
            return None
        observed = observed_host(ctx.grpc_context)
        key = (ctx.peer_id, observed, tuple(caller.addrs))
        try:
            return self._callers[key]
        except KeyError:
            pass
        node = None
        parsed = []
        for text in caller.addrs[:8]:
            try:
                addr = Multiaddr.parse(text).with_peer_id(ctx.peer_id)
            except MultiaddrError:
                continue
            if not addr.is_unspecified:
                parsed.append(addr)
        if parsed:
            # the address the caller was seen coming from; else a non-loopback one for remote callers
            chosen = next((a for a in parsed if a.host == observed), None)
            if chosen is None and observed not in (None, "127.0.0.1", "::1"):
                chosen = next((a for a in parsed if not a.host.startswith("127.") and a.host != "::1"), None)
            chosen = chosen or parsed[0]
            node = NodeInfo(node_id_of(ctx.peer_id), ctx.peer_id, str(chosen))
        if len(self._callers) > CACHE_LIMIT:
            self._callers.clear()
        self._callers[key] = node
        return node

    async def rpc_ping(self, request: dht_pb2.DHTPingRequest, ctx: CallContext) -> dht_pb2.DHTPingResponse:
        caller = self._caller_node(request.caller, ctx)
        if caller is not None:
            self.contacts.heard_from(caller)
        return dht_pb2.DHTPingResponse(dht_time=get_dht_time())

    async def rpc_leave(self, request: dht_pb2.DHTLeaveRequest, ctx: CallContext) -> dht_pb2.DHTLeaveResponse:
        if ctx.peer_id:
            self.contacts.departed(ctx.peer_id)
        return dht_pb2.DHTLeaveResponse()

    async def rpc_store(self, request: dht_pb2.DHTStoreRequest, ctx: CallContext) -> dht_pb2.DHTStoreResponse:
        if len(request.items) > MAX_ITEMS_PER_REQUEST:
            raise InvalidRequest(f"a Store request carries at most {MAX_ITEMS_PER_REQUEST} records")
        caller = self._caller_node(request.caller, ctx)
        count = min(request.count, self.config.bucket_size)
        exclude = caller.node_id if caller is not None else None
        response = dht_pb2.DHTStoreResponse()
        results = response.results
        indices: dict[DHTID, int] = {}
        for item in request.items:
            status, reason = self._store_item(item, ctx.peer_id or "", ctx.source)
            result = results.add() if status == STORED else results.add(status=status, reason=reason)
            if count and item.raw_key:
                key_id = DHTID.from_bytes(hashlib.sha256(item.raw_key).digest())
                self._add_nearest(result.nearest, key_id, count, exclude, indices, response.peers)
        if caller is not None:
            self.contacts.heard_from(caller)
        return response

    def _add_nearest(
        self, nearest: RepeatedScalarFieldContainer[int], key_id: DHTID, count: int, exclude: DHTID | None,
        indices: dict[DHTID, int], peers: RepeatedCompositeFieldContainer[dht_pb2.DHTPeer],
    ) -> None:
        """Appends to `nearest` the indices, in `peers`, of the `count` nodes nearest to `key_id`."""
        for node in self.routing_table.get_nearest_neighbors(key_id, count, exclude):
            index = indices.get(node.node_id)
            if index is None:
                index = indices[node.node_id] = len(peers)
                peers.add(peer_id=node.peer_id, addr=self._bare_addr(node.addr))
            nearest.append(index)

    def _store_item(self, item: dht_pb2.DHTStoreItem, caller: str, source: str = "") -> tuple[int, str]:
        raw_key, subkey, value, expiration_time = item.raw_key, item.subkey, item.value, item.expiration_time
        if not raw_key or len(raw_key) > MAX_RAW_KEY_BYTES or len(subkey) > MAX_SUBKEY_BYTES:
            return INVALID, f"keys and subkeys are 1..{MAX_RAW_KEY_BYTES} serialized bytes"
        if not math.isfinite(expiration_time):
            return INVALID, "the expiration time is not a finite number"
        if len(value) > self.config.max_value_bytes:
            return REFUSED, f"value of {len(value)} bytes exceeds the {self.config.max_value_bytes}-byte limit"
        horizon = self.config.expiration_horizon(_user_key(raw_key) if self.config.expiration_horizons else None)
        if expiration_time > get_dht_time() + horizon:
            return REFUSED, f"the record expires more than {horizon:g} s ahead, this node's limit for the key"
        key = hashlib.sha256(raw_key).digest()
        record = DHTRecord(key, subkey, value, expiration_time, raw_key)
        try:
            self.validator.validate(record)
            owner = record_owner(record)
        except ValidationError as e:
            return INVALID, str(e)
        target = self.cache if item.in_cache else self.storage
        if target is None:
            return REFUSED, "this node keeps no cache"
        # the owner's signature was checked: its records count against its quota, whoever forwards them
        # and every record counts against its source network's quota, however many identities it used
        if target.store(key, value, expiration_time, subkey or None, raw_key, writer=owner or caller, source=source):
            return STORED, ""
        if target.last_refusal is not None:
            return REFUSED, target.last_refusal
        target.mark_received(key, raw_key)
        if expiration_time <= get_dht_time():
            return OUTDATED, "the record has expired"
        if target.max_size is not None and len(target) >= target.max_size and key not in target:
            return REFUSED, "the node's storage is full of records that expire later"
        return OUTDATED, "a value expiring at the same time or later is already stored"

    async def rpc_find(self, request: dht_pb2.DHTFindRequest, ctx: CallContext) -> dht_pb2.DHTFindResponse:
        if len(request.keys) > MAX_ITEMS_PER_REQUEST:
            raise InvalidRequest(f"a Find request carries at most {MAX_ITEMS_PER_REQUEST} keys")
        caller = self._caller_node(request.caller, ctx)
        exclude = caller.node_id if caller is not None else None
        count = min(request.count or self.config.bucket_size, self.config.bucket_size)
        want_values, values_suffice = not request.nodes_only, request.values_suffice
        response = dht_pb2.DHTFindResponse()
        results, peers = response.results, response.peers
        indices: dict[DHTID, int] = {}
        budget = _RESPONSE_VALUE_BUDGET
        storage, cache, max_age = self.storage, self.cache, self.config.cache_max_age
        for key in request.keys:
            if len(key) != 32:
                raise InvalidRequest(f"a DHT key is 32 bytes, got {len(key)}")
            result = results.add()
            if want_values:
                found = storage.get(key)
                if cache is not None:  # a cached copy is trusted for cache_max_age, as for this node's own gets
                    found = merge(found, cache.get_fresh(key, max_age))
                if found is not None:
                    value = found.value
                    if isinstance(value, DictionaryValue):
                        value, kind = _pack_within(value, budget), dht_pb2.DHT_DICTIONARY
                    else:
                        kind = dht_pb2.DHT_VALUE
                    if value is not None and (len(value) <= budget or budget == _RESPONSE_VALUE_BUDGET):
                        budget -= len(value)
                        result.type, result.value, result.expiration_time = kind, value, found.expiration_time
                        if values_suffice:
                            continue
                    else:
                        result.type = dht_pb2.DHT_OMITTED
            self._add_nearest(result.nearest, DHTID.from_bytes(key), count, exclude, indices, peers)
        if caller is not None:
            self.contacts.heard_from(caller)
        return response

    def _bare_addr(self, addr: str) -> str:
        found = self._bare_addrs.get(addr)
        if found is None:
            if len(self._bare_addrs) > CACHE_LIMIT:
                self._bare_addrs.clear()
            found = self._bare_addrs[addr] = bare(addr)
        return found


def _user_key(raw_key: bytes) -> bytes | str | None:
    try:
        return deserialize_key(raw_key)
    except ValueError:
        return None


def _pack_within(dictionary: DictionaryValue, budget: int) -> bytes | None:
    """The packed dictionary, or, where it exceeds `budget`, as many of its subkeys as fit,
    smallest first (the latest expiring first among equals); None if not even one fits.

    An answer never grows past the message cap however much a key holds, and a writer who
    stuffs a key with large junk subkeys cannot crowd out the small records (declarations,
    sign-ups) that readers look for.
    """
    rows = [(subkey, entry.value, entry.expiration_time) for subkey, entry in dictionary.items()]
    if sum(len(s) + len(v) + _ROW_OVERHEAD for s, v, _ in rows) <= budget:
        return dictionary.packb()
    rows.sort(key=lambda row: (len(row[0]) + len(row[1]), -row[2]))
    kept, used = [], 0
    for row in rows:
        size = len(row[0]) + len(row[1]) + _ROW_OVERHEAD
        if used + size > budget:
            break
        kept.append(row)
        used += size
    return DictionaryValue(kept).packb() if kept else None
