"""The DHT's wire protocol over the peer's gRPC server (proto/dht.proto): `DHTProtocol`.

Clients are `call_*` (caller side, here), handlers `rpc_*` (callee side, `handlers.py`); Store
and Find carry many keys per call. Every message teaches the receiver about its sender (Kademlia
§2.2): an answer adds the callee on the caller's side, a request the caller on the callee's
(`contacts.py` keeps the routing table). A call that fails is an expected event: it is logged at
debug level and `call_*` returns None; a callee that refused the connection (or keeps timing out)
is dropped from the routing table and blacklisted with growing bans. A node that shuts down
cleanly says goodbye to its contacts (`call_leave`).

The names of `wire.py` (method paths, statuses, `StoreResult`, `FindAnswer`, `store_item`,
`node_id_of`) are importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

from google.protobuf.message import Message

from swarm.core.errors import DeadlineExceeded, IdentityError, MultiaddrError, PeerUnreachable, RPCError
from swarm.core.multiaddr import Multiaddr
from swarm.dht.blacklist import Blacklist
from swarm.dht.buckets import NodeInfo
from swarm.dht.config import DHTConfig
from swarm.dht.contacts import Contacts
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.handlers import DHTHandlers
from swarm.dht.ids import DHTID
from swarm.dht.routing import RoutingTable
from swarm.dht.storage import CacheStorage, DHTLocalStorage
from swarm.dht.validation import RecordValidator
from swarm.dht.wire import (
    CACHE_LIMIT,
    FIND,
    LEAVE,
    PING,
    STORE,
    FindAnswer,
    StoreResult,
    bare,
    node_id_of,
)
from swarm.metrics import REGISTRY
from swarm.net.channels import ChannelPool, PeerChannel
from swarm.net.server import RPCServer
from swarm.proto import dht_pb2

__all__ = ["DHTProtocol"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)  # the response type of a request


class DHTProtocol:
    """The DHT service of one node: its handlers (`handlers.py`) and its calls to other nodes.

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
        self.config = config
        self.client_mode = not addrs
        self.contacts = Contacts(routing_table, blacklist, self.call_ping)
        self.handlers = DHTHandlers(routing_table, self.contacts, storage, cache, validator, config)
        self._caller = dht_pb2.DHTCaller(addrs=[bare(a) for a in addrs])
        self._multiaddrs: dict[str, Multiaddr] = {}
        self._peers: dict[tuple[str, str], NodeInfo | None] = {}
        self.calls_sent: Counter[str] = Counter()
        """Requests this node sent, by method path (for monitoring and tests)."""
        self.timeouts: Counter[str] = Counter()
        """Requests that went unanswered for their timeout, by method path (each backed off its node)."""
        self.round_trip = 0.005
        pool.estimates.exclude(PING, STORE, FIND)  # `_send` measures these, link delays included
        """Moving average of answered calls' round-trip times, in seconds (to time hedged requests)."""

    def readdress(self, addrs: Sequence[str]) -> None:
        """Advertises `addrs` from now on (a peer behind NAT that moved to another relay, docs/relay.md)."""
        self._caller = dht_pb2.DHTCaller(addrs=[bare(a) for a in addrs])

    def register(self, server: RPCServer) -> None:
        """Serves Ping, Store, Find and Leave on the peer's server."""
        self.handlers.register(server)

    async def close(self) -> None:
        """Stops the background pings this protocol started (and starts no more)."""
        await self.contacts.close()

    # -- calls ------------------------------------------------------------------------------------

    def _channel(self, node: NodeInfo) -> PeerChannel:
        addr = self._multiaddrs.get(node.addr)
        if addr is None:
            if len(self._multiaddrs) > CACHE_LIMIT:
                self._multiaddrs.clear()
            addr = self._multiaddrs[node.addr] = Multiaddr.parse(node.addr)
        return self.pool.get(addr)

    async def _call(
        self, node: NodeInfo, method: str, request: Message, response_type: type[M], reraise: bool = False,
        *, resend_lost: bool = False,
    ) -> M | None:
        """One request to `node`; its answer, or None (or the error, with `reraise`) if it failed.

        With `resend_lost` (for requests that are safe to repeat), see `_send_or_resend`.
        """
        timeout = self.request_timeout_for(node)
        self.calls_sent[method] += 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        channel: PeerChannel | None = None
        try:
            channel = self._channel(node)  # the one `_send` uses (the pool keeps it)
            if not self.contacts.timeouts_in_a_row(node):
                response = await self._send_or_resend(node, method, request, response_type, timeout,
                                                      early_resend=resend_lost)
            else:
                response = await self._send(node, method, request, response_type, timeout)
        except RPCError as e:
            if isinstance(e, DeadlineExceeded):
                self._timed_out(node, method, timeout)
            self.contacts.failed(node, e, method)
            if isinstance(e, PeerUnreachable) and node.node_id not in self.routing_table:
                # no channel kept open to a node that is not there; but only the channel this call
                # used: another caller may have replaced it meanwhile (a fresh dial) and still uses it
                await self.pool.forget(node.peer_id, channel)
            if reraise:
                raise
            return None
        except MultiaddrError as e:
            logger.debug("DHT node %s has an unusable address: %s", node.peer_id, e)
            self.contacts.unusable(node)
            if reraise:
                raise
            return None
        self.round_trip += 0.1 * (loop.time() - start - self.round_trip)
        self.contacts.answered(node)
        return response

    def request_timeout_for(self, node: NodeInfo) -> float:
        """The deadline of one request to `node` (see `DHTConfig.request_timeout`): a multiple of
        its link's RFC 6298 timeout, at least `min_request_timeout`, doubled for each of its
        requests that timed out since its last answer, at most `request_timeout`."""
        cfg = self.config
        link = self.pool.estimates.get(node.peer_id)
        rto = link.rto(backed_off=False) if link is not None else None
        if link is None or rto is None:
            return cfg.request_timeout
        floor = min(cfg.min_request_timeout, cfg.request_timeout)
        measured = max(floor, cfg.request_timeout_multiple * rto) * link.backoff_factor()
        return min(cfg.request_timeout, measured)

    async def _send(self, node: NodeInfo, method: str, request: Message, response_type: type[M],
                    timeout: float) -> M:
        loop = asyncio.get_running_loop()
        channel = self._channel(node)
        await channel.verify()  # a first call's handshake is no round trip of the link
        started = loop.time()
        plan = self.config.fault_plan
        if plan is not None:
            timeout -= await plan.apply(self.peer_id, node.peer_id, timeout)
        response = await channel.unary(method, request, response_type, timeout=timeout)
        # the round trip as this caller saw it, a delay on the link included (the channel leaves
        # the DHT's methods to us: `__init__`); it sets the next request timeouts to this node
        self.pool.estimates.observe_rtt(node.peer_id, loop.time() - started)
        return response

    def _timed_out(self, node: NodeInfo, method: str, timeout: float) -> None:
        backoff = self.pool.estimates.timed_out(node.peer_id)
        self.timeouts[method] += 1
        # made on the first timeout, not at import: a DHT-only daemon loads no prometheus_client until then
        REGISTRY.counter("swarm_dht_request_timeouts_total", "DHT requests unanswered for their timeout (each "
                         "doubles its node's timeout until the node answers again)",
                         ("method",)).labels(method=method.rsplit("/", 1)[-1]).inc()
        logger.debug("DHT %s to %s timed out after %.3f s: its timeout is now %.3f s (backoff x%d)",
                     method.rsplit("/", 1)[-1], node.peer_id, timeout, self.request_timeout_for(node), 1 << backoff)

    async def _send_or_resend(self, node: NodeInfo, method: str, request: Message, response_type: type[M],
                              timeout: float, *, early_resend: bool = True) -> M:
        """Sends a request (every DHT request is safe to repeat) to a node that has been answering,
        and sends it again, racing the first, when it looks lost.

        Two resends, as TCP's (RFC 6298): with `early_resend`, once no answer came within the
        link's retransmission timeout (a few round trips: a lost request or answer, which a lookup
        should not wait out); and once `timeout`, the node's measured request timeout, ran out
        with no answer: the node's timeout then doubles (`LinkEstimates.timed_out`), and the
        request is sent again with that backed-off timeout while the first may still answer. A
        link that slowed down after it was measured (1 ms, then 1.5 s) so still gets its answer;
        a dead node costs the measured timeout plus the backed-off one, at most
        `DHTConfig.request_timeout` (the cap, which a node never measured gets at once and which
        is never exceeded). A node that timed out before gets no second request (`_call`).
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        cap = self.config.request_timeout
        backed_off = min(cap - timeout, 2 * timeout) if timeout < cap else 0.0
        deadline = started + timeout + backed_off
        name = method.rsplit("/", 1)[-1]
        attempts = {asyncio.ensure_future(self._send(node, method, request, response_type, deadline - started))}
        try:
            # the RFC 6298 timeout of this link as measured by the channel layer
            resend_after = self.pool.estimates.retransmit_after(
                node.peer_id, floor=0.02, cap=timeout / 2, default=5 * self.round_trip)
            logger.debug("DHT %s to %s: resend after %.3f s, timeout %.3f s, then %.3f s (RTT %s)", name,
                         node.peer_id, resend_after, timeout, backed_off, self.pool.estimates.rtt(node.peer_id))
            if early_resend:
                done, _ = await asyncio.wait(attempts, timeout=resend_after)
                if not done:
                    self.calls_sent[method] += 1
                    logger.debug("DHT %s to %s unanswered for a while: sending it once more", name, node.peer_id)
                    attempts.add(asyncio.ensure_future(
                        self._send(node, method, request, response_type, deadline - loop.time())))
            if backed_off > 0:
                done, _ = await asyncio.wait(attempts, timeout=max(0.0, started + timeout - loop.time()))
                if not done:
                    self._timed_out(node, method, timeout)
                    self.calls_sent[method] += 1
                    attempts.add(asyncio.ensure_future(
                        self._send(node, method, request, response_type, deadline - loop.time())))
            error: BaseException | None = None
            while attempts:
                done, attempts = await asyncio.wait(attempts, return_when=asyncio.FIRST_COMPLETED)
                for attempt in done:
                    if attempt.cancelled():  # never by us while we wait: its channel went away
                        error = PeerUnreachable(f"{method} to {node.peer_id} was cancelled", peer_id=node.peer_id)
                    elif attempt.exception() is None:
                        return attempt.result()
                    else:
                        error = attempt.exception()
            assert error is not None
            raise error
        finally:
            for attempt in attempts:
                attempt.cancel()

    async def call_ping(self, node: NodeInfo, *, reraise: bool = False, resend_lost: bool = False) -> bool:
        """True if `node` answered (it is then in the routing table).

        Args:
            node: The node to ping.
            reraise: Raise the `RPCError` of a failed call (to report why) instead of returning False.
            resend_lost: Send the ping once more if it is unanswered after the link's resend delay
                (`_send_or_resend`): a join's first contact should not hinge on one lost message.
        """
        request = dht_pb2.DHTPingRequest(caller=self._caller)
        return await self._call(node, PING, request, dht_pb2.DHTPingResponse, reraise,
                                resend_lost=resend_lost) is not None

    async def call_leave(self, node: NodeInfo, timeout: float) -> bool:
        """Tells `node` that this node is leaving (so it drops this node at once); True if it took note.

        A goodbye is best-effort: a node that does not answer within `timeout` is not held
        against it (this node is going away and keeps no table to drop it from).
        """
        self.calls_sent[LEAVE] += 1
        try:
            plan = self.config.fault_plan
            if plan is not None:
                timeout -= await plan.apply(self.peer_id, node.peer_id, timeout)
            await self._channel(node).unary(LEAVE, dht_pb2.DHTLeaveRequest(), dht_pb2.DHTLeaveResponse, timeout=timeout)
        except (RPCError, MultiaddrError) as e:
            logger.debug("DHT goodbye to %s failed: %s", node.peer_id, e)
            return False
        return True

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
        peers = self._answer_peers(node, response.peers, len(items) * max(count, self.config.max_contacts_per_answer))
        if peers is None:
            return None
        return [StoreResult(r.status, r.reason, self._nearest(peers, r.nearest)) for r in response.results]

    def _nearest(self, peers: _Peers, indices: Sequence[int]) -> list[NodeInfo]:
        """The nodes an answer names for one key, at most `max_contacts_per_answer` of them."""
        nearest: list[NodeInfo] = []
        limit = self.config.max_contacts_per_answer
        for index in indices[:limit]:
            peer = peers.get(index)
            if peer is not None:
                nearest.append(peer)
        return nearest

    def _answer_peers(self, node: NodeInfo, peers: Sequence[dht_pb2.DHTPeer], most: int) -> _Peers | None:
        """The peers an answer names, parsed as they are used; None (and `node` distrusted) if it
        names more than the `most` an honest node would (the count asked for, per key)."""
        if len(peers) > most:
            self.distrust(node, f"its answer names {len(peers)} nodes, more than the {most} asked for")
            return None
        return _Peers(self, peers)

    def distrust(self, node: NodeInfo, reason: str) -> None:
        """Drops and bans a node caught lying (an answer no honest node would give): lookups skip it."""
        logger.info("DHT node %s sent an answer no honest node would: %s; it is banned", node.peer_id, reason)
        self.contacts.failures["lied"] += 1
        self.contacts.blacklist.register_failure(node.peer_id)
        self.routing_table.remove(node.node_id)

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
        count = count or self.config.bucket_size  # said explicitly: the callee's own k may be larger
        request = dht_pb2.DHTFindRequest(
            caller=self._caller, keys=[key.to_bytes() for key in keys], nodes_only=nodes_only,
            values_suffice=values_suffice, count=count,
        )
        response = await self._call(node, FIND, request, dht_pb2.DHTFindResponse, resend_lost=True)
        if response is None:
            return None
        if len(response.results) != len(keys):
            logger.debug("DHT node %s answered %d of %d keys", node.peer_id, len(response.results), len(keys))
            return None
        peers = self._answer_peers(node, response.peers, len(keys) * max(count, self.config.max_contacts_per_answer))
        if peers is None:
            return None
        answers: dict[DHTID, FindAnswer] = {}
        max_value_bytes = self.config.max_value_bytes
        for key, result in zip(keys, response.results):
            nearest = self._nearest(peers, result.nearest)
            kind, value = result.type, None
            if kind == dht_pb2.DHT_VALUE:
                if len(result.value) > max_value_bytes:
                    self.distrust(node, f"it sent a value of {len(result.value)} bytes")
                    return None
                value = ValueWithExpiration(result.value, result.expiration_time)
            elif kind == dht_pb2.DHT_DICTIONARY:
                try:
                    dictionary = DictionaryValue.unpackb(result.value)
                except ValueError as e:
                    self.distrust(node, f"it sent a malformed dictionary: {e}")
                    return None
                if any(len(entry.value) > max_value_bytes for _, entry in dictionary.items()):
                    self.distrust(node, "it sent a subkey whose value exceeds the size limit")
                    return None
                value = ValueWithExpiration(dictionary, result.expiration_time)
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
        if len(self._peers) > CACHE_LIMIT:
            self._peers.clear()
        self._peers[key] = node
        return node


class _Peers:
    """The peers of one answer, each parsed (`DHTProtocol._peer_node`) when first used."""

    __slots__ = ("_parsed", "_protocol", "_raw")

    def __init__(self, protocol: DHTProtocol, raw: Sequence[dht_pb2.DHTPeer]) -> None:
        self._protocol = protocol
        self._raw = raw
        self._parsed: dict[int, NodeInfo | None] = {}

    def get(self, index: int) -> NodeInfo | None:
        if not 0 <= index < len(self._raw):
            return None
        try:
            return self._parsed[index]
        except KeyError:
            peer = self._raw[index]
            node = self._parsed[index] = self._protocol._peer_node(peer.peer_id, peer.addr)
            return node
