"""The DHT's wire protocol: Ping, Store and Find over the peer's gRPC server (proto/dht.proto).

Handlers are `rpc_*` (callee side), clients `call_*` (caller side); Store and Find carry many
keys per call. Every message teaches the receiver about its sender (Kademlia §2.2): a request
adds the caller to the callee's routing table, under the PeerID the transport authenticated
and with the address the request names (trusted for that PeerID only); a caller in client mode
names no address and is never added. An answer adds the callee on the caller's side. When a
bucket is full, its least-recently seen node is pinged and replaced only if it is gone (§2.2).
A call that fails is an expected event: it is logged at debug level and `call_*` returns None; a
callee that refused the connection (or keeps timing out) is dropped from the routing table and
blacklisted with growing bans.

A receiver checks every record it is asked to store with the node's validators and answers
each item with a status and, when refused, the reason, which travels back to the writer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from google.protobuf.message import Message

from swarm.core.errors import (
    DeadlineExceeded,
    IdentityError,
    InvalidRequest,
    MultiaddrError,
    PeerUnreachable,
    RPCError,
    Unauthenticated,
    ValidationError,
)
from swarm.core.loop import spawn
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.dht.config import DHTConfig
from swarm.dht.routing import DHTID, Blacklist, NodeInfo, RoutingTable
from swarm.dht.storage import CacheStorage, DHTLocalStorage, DictionaryValue, ValueWithExpiration, merge
from swarm.dht.validation import DHTRecord, RecordValidator
from swarm.net.channels import ChannelPool, PeerChannel
from swarm.net.server import CallContext, RPCServer
from swarm.proto import dht_pb2

logger = logging.getLogger(__name__)

PING = "/swarm.DHT/Ping"
STORE = "/swarm.DHT/Store"
FIND = "/swarm.DHT/Find"

MAX_ITEMS_PER_REQUEST = 4096
"""Most keys or records one request may carry."""
MAX_RAW_KEY_BYTES = 4096
MAX_SUBKEY_BYTES = 4096
_RESPONSE_VALUE_BUDGET = 4 << 20  # bytes of values in one Find answer; past it values are omitted
_CACHE_LIMIT = 65536  # entries of the small parse caches below before they are cleared
_TIMEOUTS_TO_DROP = 3  # timeouts in a row after which a node counts as gone
_RECHECK_AFTER = 30.0  # seconds during which a contact that answered a liveness check is not checked again

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
        if len(_cache) > _CACHE_LIMIT:
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


def _bare(addr: str) -> str:
    cut = addr.find("/p2p/")
    return addr if cut < 0 else addr[:cut]


def _observed_host(grpc_context: Any) -> str | None:
    """The caller's IP as the transport saw it ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
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


class DHTProtocol:
    """The Ping/Store/Find service of one node and the client calls to other nodes.

    Args:
        peer_id: This node's PeerID.
        addrs: The multiaddrs this node is reachable at; empty in client mode.
        pool: The peer's channels.
        routing_table: This node's k-buckets (updated by every message).
        blacklist: Peers that failed to answer.
        storage: Records this node keeps for the DHT.
        cache: Records cached from lookups, or None.
        validator: Checks every record asked to be stored.
        config: Timeouts, sizes, fault plan.
    """

    def __init__(
        self,
        peer_id: str,
        addrs: Sequence[str],
        pool: ChannelPool,
        routing_table: RoutingTable,
        blacklist: Blacklist,
        storage: DHTLocalStorage,
        cache: CacheStorage | None,
        validator: RecordValidator,
        config: DHTConfig,
    ) -> None:
        self.peer_id = peer_id
        self.node_id = routing_table.node_id
        self.pool = pool
        self.routing_table = routing_table
        self.blacklist = blacklist
        self.storage = storage
        self.cache = cache
        self.validator = validator
        self.config = config
        self.client_mode = not addrs
        self._caller = dht_pb2.DHTCaller(addrs=[_bare(a) for a in addrs])
        self._multiaddrs: dict[str, Multiaddr] = {}
        self._callers: dict[tuple[str, str | None, tuple[str, ...]], NodeInfo | None] = {}
        self._peers: dict[tuple[str, str], NodeInfo | None] = {}
        self._bare_addrs: dict[str, str] = {}
        self._pinging: set[DHTID] = set()
        self._checked: dict[DHTID, float] = {}
        self._timeouts: dict[str, int] = {}  # consecutive timeouts per peer
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.calls_sent: Counter[str] = Counter()
        """Requests this node sent, by method path (for monitoring and tests)."""
        self.round_trip = 0.005
        """Moving average of answered calls' round-trip times, in seconds (to time hedged requests)."""

    def register(self, server: RPCServer) -> None:
        """Serves Ping, Store and Find on the peer's server."""
        server.add_unary(PING, self.rpc_ping, dht_pb2.DHTPingRequest)
        server.add_unary(STORE, self.rpc_store, dht_pb2.DHTStoreRequest)
        server.add_unary(FIND, self.rpc_find, dht_pb2.DHTFindRequest)

    async def close(self) -> None:
        """Stops the background pings this protocol started (and starts no more)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- routing table upkeep (§2.2) ----------------------------------------------------------

    def heard_from(self, node: NodeInfo) -> None:
        """Records that `node` is alive; pings the stalest contact of its bucket if that is full."""
        if self.blacklist.is_banned(node.peer_id):
            return
        stale = self.routing_table.add_or_update(node.node_id, node.peer_id, node.addr)
        if stale is None or stale.node_id in self._pinging or self._closed:
            return
        now = time.monotonic()
        if now - self._checked.get(stale.node_id, -math.inf) < _RECHECK_AFTER:
            return  # it answered a check a moment ago: keep it, and the newcomer waits in the cache
        if len(self._checked) > _CACHE_LIMIT:
            self._checked.clear()
        self._checked[stale.node_id] = now
        self._pinging.add(stale.node_id)
        task = spawn(self._check_stale(stale), name=f"dht-ping-stale-{stale.peer_id[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check_stale(self, node: NodeInfo) -> None:
        try:
            await self.call_ping(node)  # on failure, call_ping removes it and a cached node takes its place
        finally:
            self._pinging.discard(node.node_id)

    def _failed(self, node: NodeInfo, error: RPCError, method: str) -> None:
        """Drops and bans a node that is gone, or is not who it claimed, or keeps timing out.

        A refused connection is proof enough; a timeout is not (a lost packet, a busy peer), so
        a node is dropped after `_TIMEOUTS_TO_DROP` timeouts in a row (§4.1 tolerates a few).
        """
        logger.debug("DHT %s to %s failed: %s", method.rsplit("/", 1)[-1], node.peer_id, error)
        if isinstance(error, DeadlineExceeded):
            strikes = self._timeouts.get(node.peer_id, 0) + 1
            if strikes < _TIMEOUTS_TO_DROP:
                if len(self._timeouts) > _CACHE_LIMIT:
                    self._timeouts.clear()
                self._timeouts[node.peer_id] = strikes
                return
        if isinstance(error, (PeerUnreachable, DeadlineExceeded, Unauthenticated)):
            self._timeouts.pop(node.peer_id, None)
            self.blacklist.register_failure(node.peer_id)
            self.routing_table.remove(node.node_id)

    # -- callee side ------------------------------------------------------------------------------

    def _caller_node(self, caller: dht_pb2.DHTCaller, ctx: CallContext) -> NodeInfo | None:
        """The caller as a routing-table entry, or None (client mode, or no usable address)."""
        if not caller.addrs or not ctx.peer_id:
            return None
        observed = _observed_host(ctx.grpc_context)
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
        if len(self._callers) > _CACHE_LIMIT:
            self._callers.clear()
        self._callers[key] = node
        return node

    async def rpc_ping(self, request: dht_pb2.DHTPingRequest, ctx: CallContext) -> dht_pb2.DHTPingResponse:
        caller = self._caller_node(request.caller, ctx)
        if caller is not None:
            self.heard_from(caller)
        return dht_pb2.DHTPingResponse(dht_time=get_dht_time())

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
            status, reason = self._store_item(item)
            result = results.add() if status == STORED else results.add(status=status, reason=reason)
            if count and item.raw_key:
                key_id = DHTID.from_bytes(hashlib.sha256(item.raw_key).digest())
                self._add_nearest(result.nearest, key_id, count, exclude, indices, response.peers)
        if caller is not None:
            self.heard_from(caller)
        return response

    def _add_nearest(
        self, nearest: Any, key_id: DHTID, count: int, exclude: DHTID | None, indices: dict[DHTID, int], peers: Any
    ) -> None:
        """Appends to `nearest` the indices, in `peers`, of the `count` nodes nearest to `key_id`."""
        for node in self.routing_table.get_nearest_neighbors(key_id, count, exclude):
            index = indices.get(node.node_id)
            if index is None:
                index = indices[node.node_id] = len(peers)
                peers.add(peer_id=node.peer_id, addr=self._bare_addr(node.addr))
            nearest.append(index)

    def _store_item(self, item: dht_pb2.DHTStoreItem) -> tuple[int, str]:
        raw_key, subkey, value, expiration_time = item.raw_key, item.subkey, item.value, item.expiration_time
        if not raw_key or len(raw_key) > MAX_RAW_KEY_BYTES or len(subkey) > MAX_SUBKEY_BYTES:
            return INVALID, f"keys and subkeys are 1..{MAX_RAW_KEY_BYTES} serialized bytes"
        if not math.isfinite(expiration_time):
            return INVALID, "the expiration time is not a finite number"
        if len(value) > self.config.max_value_bytes:
            return REFUSED, f"value of {len(value)} bytes exceeds the {self.config.max_value_bytes}-byte limit"
        key = hashlib.sha256(raw_key).digest()
        try:
            self.validator.validate(DHTRecord(key, subkey, value, expiration_time, raw_key))
        except ValidationError as e:
            return INVALID, str(e)
        target = self.cache if item.in_cache else self.storage
        if target is None:
            return REFUSED, "this node keeps no cache"
        if target.store(key, value, expiration_time, subkey or None, raw_key):
            return STORED, ""
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
        storage, cache = self.storage, self.cache
        for key in request.keys:
            if len(key) != 32:
                raise InvalidRequest(f"a DHT key is 32 bytes, got {len(key)}")
            result = results.add()
            if want_values:
                found = storage.get(key)
                if cache is not None:
                    found = merge(found, cache.get(key))
                if found is not None:
                    value = found.value
                    if isinstance(value, DictionaryValue):
                        value, kind = value.packb(), dht_pb2.DHT_DICTIONARY
                    else:
                        kind = dht_pb2.DHT_VALUE
                    if len(value) <= budget or budget == _RESPONSE_VALUE_BUDGET:
                        budget -= len(value)
                        result.type, result.value, result.expiration_time = kind, value, found.expiration_time
                        if values_suffice:
                            continue
                    else:
                        result.type = dht_pb2.DHT_OMITTED
            self._add_nearest(result.nearest, DHTID.from_bytes(key), count, exclude, indices, peers)
        if caller is not None:
            self.heard_from(caller)
        return response

    def _bare_addr(self, addr: str) -> str:
        bare = self._bare_addrs.get(addr)
        if bare is None:
            if len(self._bare_addrs) > _CACHE_LIMIT:
                self._bare_addrs.clear()
            bare = self._bare_addrs[addr] = _bare(addr)
        return bare

    # -- caller side ------------------------------------------------------------------------------

    def _channel(self, node: NodeInfo) -> PeerChannel:
        addr = self._multiaddrs.get(node.addr)
        if addr is None:
            if len(self._multiaddrs) > _CACHE_LIMIT:
                self._multiaddrs.clear()
            addr = self._multiaddrs[node.addr] = Multiaddr.parse(node.addr)
        return self.pool.get(addr)

    async def _call(
        self, node: NodeInfo, method: str, request: Message, response_type: type[Message], reraise: bool = False
    ) -> Any:
        timeout = self.config.request_timeout
        self.calls_sent[method] += 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            plan = self.config.fault_plan
            if plan is not None:
                timeout -= await plan.apply(self.peer_id, node.peer_id, timeout)
            response = await self._channel(node).unary(method, request, response_type, timeout=timeout)
        except RPCError as e:
            self._failed(node, e, method)
            if reraise:
                raise
            return None
        except MultiaddrError as e:
            logger.debug("DHT node %s has an unusable address: %s", node.peer_id, e)
            self.routing_table.remove(node.node_id)
            if reraise:
                raise
            return None
        self.round_trip += 0.1 * (loop.time() - start - self.round_trip)
        if self._timeouts:
            self._timeouts.pop(node.peer_id, None)
        self.blacklist.register_success(node.peer_id)
        self.heard_from(node)
        return response

    async def call_ping(self, node: NodeInfo, *, reraise: bool = False) -> bool:
        """True if `node` answered (it is then in the routing table).

        Args:
            node: The node to ping.
            reraise: Raise the `RPCError` of a failed call (to report why) instead of returning False.
        """
        request = dht_pb2.DHTPingRequest(caller=self._caller)
        return await self._call(node, PING, request, dht_pb2.DHTPingResponse, reraise) is not None

    async def call_store(
        self, node: NodeInfo, items: Sequence[dht_pb2.DHTStoreItem], count: int = 0
    ) -> list[StoreResult] | None:
        """Asks `node` to store records; its answer for each, in order, or None if it did not answer.

        Args:
            node: The node to ask.
            items: The records (`store_item`).
            count: Also ask for the nodes it knows nearest to each record's key, this many.
        """
        request = dht_pb2.DHTStoreRequest(caller=self._caller, items=items, count=count)
        response = await self._call(node, STORE, request, dht_pb2.DHTStoreResponse)
        if response is None:
            return None
        if len(response.results) != len(items):
            logger.debug("DHT node %s answered %d of %d store items", node.peer_id, len(response.results), len(items))
            return None
        if not count:
            return [StoreResult(r.status, r.reason) for r in response.results]
        peers = [self._peer_node(p.peer_id, p.addr) for p in response.peers]
        return [StoreResult(r.status, r.reason, self._nearest(peers, r.nearest)) for r in response.results]

    @staticmethod
    def _nearest(peers: list[NodeInfo | None], indices: Sequence[int]) -> list[NodeInfo]:
        nearest = []
        for index in indices:
            if index < len(peers):
                peer = peers[index]
                if peer is not None:
                    nearest.append(peer)
        return nearest

    async def call_find(
        self, node: NodeInfo, keys: Sequence[DHTID], *, nodes_only: bool = False,
        values_suffice: bool = False, count: int = 0,
    ) -> dict[DHTID, FindAnswer] | None:
        """Asks `node` for the values of `keys` and its nearest nodes to each; None if it did not answer.

        Args:
            node: The node to ask.
            keys: Key (or node) IDs.
            nodes_only: Ask for nearest nodes only (no values).
            values_suffice: The nearest nodes of a key are not wanted if its value comes back.
            count: How many nearest nodes per key (0: k).
        """
        request = dht_pb2.DHTFindRequest(
            caller=self._caller, keys=[key.to_bytes() for key in keys], nodes_only=nodes_only,
            values_suffice=values_suffice, count=count,
        )
        response = await self._call(node, FIND, request, dht_pb2.DHTFindResponse)
        if response is None:
            return None
        if len(response.results) != len(keys):
            logger.debug("DHT node %s answered %d of %d keys", node.peer_id, len(response.results), len(keys))
            return None
        peers = [self._peer_node(p.peer_id, p.addr) for p in response.peers]
        answers: dict[DHTID, FindAnswer] = {}
        for key, result in zip(keys, response.results):
            nearest = self._nearest(peers, result.nearest)
            kind, value = result.type, None
            if kind == dht_pb2.DHT_VALUE:
                value = ValueWithExpiration(result.value, result.expiration_time)
            elif kind == dht_pb2.DHT_DICTIONARY:
                try:
                    value = ValueWithExpiration(DictionaryValue.unpackb(result.value), result.expiration_time)
                except ValueError as e:
                    logger.debug("DHT node %s sent a malformed dictionary: %s", node.peer_id, e)
            answers[key] = FindAnswer(value, nearest, kind == dht_pb2.DHT_OMITTED)
        return answers

    def _peer_node(self, peer_id: str, addr: str) -> NodeInfo | None:
        """A node named in an answer, checked (a valid PeerID and multiaddr), or None."""
        key = (peer_id, addr)
        try:
            return self._peers[key]
        except KeyError:
            pass
        node = None
        try:
            full = Multiaddr.parse(f"{addr}/p2p/{peer_id}")
            if not full.is_unspecified:
                node = NodeInfo(node_id_of(peer_id), peer_id, str(full))
        except (MultiaddrError, IdentityError, ValueError):
            logger.debug("DHT answer names an unusable peer %r at %r", peer_id, addr)
        if len(self._peers) > _CACHE_LIMIT:
            self._peers.clear()
        self._peers[key] = node
        return node
