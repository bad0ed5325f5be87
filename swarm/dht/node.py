"""`DHTNode`: the policy of one Kademlia node (Maymounkov & Mazières, IPTPS 2002).

What a node does with the protocol (`protocol.py`) and the lookup (`traversal.py`):

- join (§2.3): contact the initial peers, look up its own ID, then refresh the buckets farther
  than its nearest neighbour; fail with `DHTError` when no initial peer answers;
- store: put records on the `num_replicas` nodes nearest to their keys (`replication.py`);
- get: find values, the first valid one or the freshest, and cache them (`retrieval.py`);
- keep up (§2.3, §2.5): refresh buckets nobody touched for `refresh_interval` (a far bucket by
  a lookup that ends once `alpha` nodes answered, the node's own bucket by a full one), republish
  records nobody re-stored for `republish_interval`, plus those this node wrote itself, and hand
  records over to new nodes that are now among the nearest to their keys (`handoff.py`);
- leave: a node that shuts down cleanly tells the nodes in its routing table, so that they drop
  it at once instead of finding out through failed calls.

Records arrive here already signed and checked by the caller's validators (`dht.py`); values
found on the network are checked again, since any node may lie.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TypeVar

from swarm.core.errors import DeadlineExceeded, DHTError, MultiaddrError, RPCError
from swarm.core.loop import spawn
from swarm.core.multiaddr import Multiaddr
from swarm.core.timeutil import get_dht_time
from swarm.dht.blacklist import Blacklist
from swarm.dht.buckets import NodeInfo
from swarm.dht.config import DHTConfig
from swarm.dht.context import LookupStats
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.handoff import Handoff
from swarm.dht.ids import DHTID
from swarm.dht.protocol import DHTProtocol
from swarm.dht.replication import Replicator, stored_records
from swarm.dht.retrieval import Retriever
from swarm.dht.routing import RoutingTable
from swarm.dht.storage import CacheStorage, DHTLocalStorage, StorageQuota
from swarm.dht.store_outcome import StoreOutcome
from swarm.dht.traversal import AskFn, LookupResult, Traversal
from swarm.dht.validation import DHTRecord, RecordValidator
from swarm.dht.wire import node_id_of
from swarm.net.channels import ChannelPool
from swarm.net.server import RPCServer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DHTNode:
    """One Kademlia node on a peer's server and channels (see the module docstring).

    Build it with `await DHTNode.create(...)`; `swarm.dht.DHT` wraps it for users.
    """

    def __init__(
        self,
        peer_id: str,
        addrs: Sequence[str],
        pool: ChannelPool,
        config: DHTConfig,
        validator: RecordValidator,
    ) -> None:
        self.config = config
        self.peer_id = peer_id
        self.node_id = node_id_of(peer_id)
        self.client_mode = not addrs
        self.validator = validator
        self.routing_table = RoutingTable(self.node_id, config.bucket_size, config.depth_modulo,
                                          diversity=config.diversity)
        self.blacklist = Blacklist(config.blacklist_base_time, 2.0, config.blacklist_max_time)
        quota = StorageQuota(
            max_bytes=config.storage_bytes, max_key_bytes=config.max_key_bytes, max_subkeys=config.max_subkeys,
            max_writer_bytes=config.max_writer_bytes, max_writer_records=config.max_writer_records,
            max_source_bytes=config.max_source_bytes, max_source_records=config.max_source_records,
        )
        self.storage = DHTLocalStorage(max_size=config.storage_size, quota=quota)
        self.cache = CacheStorage(max_size=config.cache_size, quota=quota) if config.cache_size else None
        self.protocol = DHTProtocol(
            peer_id, addrs, pool, self.routing_table, self.blacklist, self.storage, self.cache, validator, config
        )
        self.pool = pool
        self.stats = LookupStats()
        self.published: dict[tuple[bytes, bytes], DHTRecord] = {}
        """Records this node wrote, republished until they expire (§2.5)."""
        self._tasks: set[asyncio.Task[object]] = set()
        self.closed = False
        self._replicator = Replicator(self)
        self._retriever = Retriever(self)
        self.handoff = Handoff(self)
        if not self.client_mode:  # a client keeps no records to hand over
            self.protocol.contacts.on_new_node = self.handoff.welcome

    @classmethod
    async def create(
        cls,
        *,
        peer_id: str,
        addrs: Sequence[str],
        pool: ChannelPool,
        server: RPCServer | None,
        config: DHTConfig,
        validator: RecordValidator,
        initial_peers: Sequence[Multiaddr] = (),
    ) -> DHTNode:
        """Starts serving the DHT on `server` (None: client mode) and joins through `initial_peers`.

        Raises:
            DHTError: Initial peers were given and none of them answered.
        """
        node = cls(peer_id, addrs if server is not None else (), pool, config, validator)
        if server is not None:
            node.protocol.register(server)
        try:
            await node.bootstrap(initial_peers)
        except BaseException:
            await node.shutdown()
            raise
        node.spawn(node._refresh_loop(), "dht-refresh")
        node.spawn(node._republish_loop(), "dht-republish")
        return node

    def spawn(self, coro: Coroutine[object, None, T], name: str) -> asyncio.Task[T]:
        task = spawn(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def adopt(self, task: asyncio.Task[object]) -> None:
        """Keeps a task running in the background, cancelled at shutdown (a lookup's request to a
        suspect: `traversal.Traversal`)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self, *, leave: bool = True) -> None:
        """Stops background work (refresh, republish, stores in flight, hand-offs, pings) and leaves.

        Args:
            leave: Leave politely: give the last replicas of stores that already returned up to
                `leave_timeout` to be written, then tell the nodes in the routing table that this
                node is leaving (within `leave_timeout` too). False stops at once, as a crash
                would (for tests and simulations).
        """
        if self.closed:
            return
        self.closed = True
        if leave and self.config.leave_timeout > 0:
            await self._replicator.wait(self.config.leave_timeout)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if leave and not self.client_mode and self.config.leave_timeout > 0:
            await self._say_goodbye(self.config.leave_timeout)
        await self.protocol.close()

    async def _say_goodbye(self, timeout: float) -> None:
        """Best effort: nodes that do not take note within `timeout` find out by themselves."""
        calls = [asyncio.ensure_future(self.protocol.call_leave(node, timeout)) for node in self.routing_table]
        if not calls:
            return
        try:
            await asyncio.wait(calls, timeout=timeout)
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    # -- joining (§2.3) ---------------------------------------------------------------------------

    async def bootstrap(self, initial_peers: Sequence[Multiaddr]) -> None:
        """Joins the DHT through any of `initial_peers` (§2.3).

        Raises:
            DHTError: None of them answered; the message says why for each.
        """
        peers = [addr for addr in initial_peers if addr.peer_id != self.peer_id]
        if not peers:
            return
        errors = await asyncio.gather(*(self._contact(addr) for addr in peers))
        if all(error is not None for error in errors):
            reasons = "; ".join(f"{addr}: {error}" for addr, error in zip(peers, errors))
            raise DHTError(f"could not join the DHT: none of the {len(peers)} initial peers answered ({reasons})")
        down = sum(error is not None for error in errors)
        if down:
            logger.info("joined the DHT through %d of %d initial peers", len(peers) - down, len(peers))
        await self.find_nearest_nodes([self.node_id])
        self.spawn(self._refresh_far_buckets(), "dht-join-refresh")

    async def _contact(self, addr: Multiaddr, attempts: int = 2) -> str | None:
        """Pings an initial peer; None on success, else why it failed.

        A peer that refuses the connection fails at once; one that is slow to answer gets a
        second chance (a busy peer, a lost packet), so joining does not hinge on one request.
        """
        timeout = self.config.request_timeout
        for attempt in range(attempts):
            try:
                peer_id = addr.peer_id
                if peer_id is None:
                    peer_id = (await asyncio.wait_for(self.pool.dial_unknown(addr), timeout)).peer_id
                node = NodeInfo(node_id_of(peer_id), peer_id, str(addr.with_peer_id(peer_id)))
                await self.protocol.call_ping(node, reraise=True, resend_lost=True)
                return None
            except DeadlineExceeded as e:
                error = str(e)
            except TimeoutError:
                error = f"no answer within {timeout} s"
            except (RPCError, MultiaddrError) as e:
                return str(e)
            if attempt + 1 < attempts:
                logger.debug("initial peer %s is slow to answer (%s); trying again", addr, error)
        return error

    async def _refresh_far_buckets(self) -> None:
        """§2.3: after joining, refresh every bucket farther away than the nearest neighbour."""
        nearest = self.routing_table.get_nearest_neighbors(self.node_id, 1)
        if not nearest:
            return
        closest = nearest[0].node_id ^ self.node_id
        ids = [
            DHTID.generate(bucket.lower, bucket.upper)
            for bucket in self.routing_table.buckets
            if not bucket.has_in_range(self.node_id) and (bucket.lower ^ self.node_id) > closest
        ]
        if ids:
            await self._refresh_lookup(ids)

    async def _refresh_lookup(self, ids: Sequence[DHTID]) -> None:
        """Looks up random IDs of buckets that need filling or checking, cheaply (§2.3 refresh).

        A refresh has to hear from some live nodes in the bucket's range and learn the others,
        not to pin down the k nodes nearest to an ID nobody stores anything under: so the lookup
        ends once the `alpha` nearest nodes it found have answered, each answer still naming k
        nodes. A full lookup (k nodes must answer) cost ~22 requests per bucket in the
        simulation (scripts/bench/sim_dht.py), and the buckets nobody's traffic touches grow in
        number with the swarm (the relaxed splitting of §4.2 keeps up to 2^b far buckets), so
        upkeep grew ~linearly with N; this one costs a few requests.
        """
        beam = min(self.config.alpha, self.config.bucket_size)
        await self.find_nearest_nodes(ids, beam_size=beam, count=self.config.bucket_size)

    # -- lookups ------------------------------------------------------------------------------------

    def _initial(self, query_ids: Sequence[DHTID]) -> dict[DHTID, list[NodeInfo]]:
        k = self.config.bucket_size
        return {query_id: self.routing_table.get_nearest_neighbors(query_id, k) for query_id in query_ids}

    def lookup(
        self, query_ids: Sequence[DHTID], ask: AskFn, beam_size: int,
        on_finished: Callable[[list[tuple[DHTID, LookupResult]]], None] | None, alpha: int | None = None,
        hedge_after: float | None = None,
    ) -> Traversal:
        # §2.3: a node that fails to answer quickly frees its place among the alpha requests in
        # flight, so a lost request does not stall the lookup (its answer still counts)
        slow_after = min(self.config.request_timeout / 2, max(0.25, 5 * self.protocol.round_trip))
        return Traversal(
            self._initial(query_ids), ask, beam_size=beam_size, alpha=alpha or self.config.alpha,
            max_keys_per_call=self.config.max_keys_per_call, exclude=(self.node_id,),
            is_banned=self.blacklist.is_banned, is_suspect=self.protocol.contacts.is_suspect, adopt=self.adopt,
            on_finished=on_finished, hedge_after=hedge_after,
            slow_after=slow_after, disjoint_paths=self.config.disjoint_paths,
        )

    async def find_nearest_nodes(
        self, query_ids: Sequence[DHTID], beam_size: int | None = None, timeout: float | None = None,
        count: int | None = None,
    ) -> dict[DHTID, list[NodeInfo]]:
        """The nodes nearest to each ID that answered, nearest first (§2.3 node lookup).

        Args:
            query_ids: Node or key IDs.
            beam_size: How many nearest nodes must answer (default k).
            timeout: Deadline of the whole lookup (default `lookup_timeout`).
            count: How many nodes each answer names per ID (default `beam_size`).
        """
        beam = beam_size or self.config.bucket_size
        per_answer = count or beam

        async def ask(node: NodeInfo, keys: list[DHTID]) -> dict[DHTID, list[NodeInfo]] | None:
            answers = await self.protocol.call_find(node, keys, nodes_only=True, count=per_answer)
            return None if answers is None else {key: answer.nearest for key, answer in answers.items()}

        def finished(results: list[tuple[DHTID, LookupResult]]) -> None:
            for _, result in results:
                self.stats.record(result.hops, result.requests, timed_out=result.timed_out)

        traversal = self.lookup(list(dict.fromkeys(query_ids)), ask, beam, finished)
        results = await traversal.run(self.config.lookup_timeout if timeout is None else timeout)
        return {query_id: result.nearest for query_id, result in results.items()}

    # -- store and get (replication.py, retrieval.py) ----------------------------------------------

    async def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Waits until the stores this node made have reached every replica (a store returns once
        the nearest one holds the record; the others are written in the background).

        Returns:
            True if no store is left in flight (False: `timeout` passed first).
        """
        return await self._replicator.wait(timeout)

    async def store_many(
        self,
        records: Sequence[DHTRecord],
        *,
        timeout: float | None = None,
        on_result: Callable[[int, StoreOutcome], None] | None = None,
        republish: bool = True,
    ) -> list[StoreOutcome]:
        """Stores each record on the `num_replicas` nodes nearest to its key (`Replicator.store_many`)."""
        return await self._replicator.store_many(records, timeout=timeout, on_result=on_result, republish=republish)

    async def get_many(
        self,
        raw_keys: Sequence[bytes],
        *,
        latest: bool = False,
        timeout: float | None = None,
        on_result: Callable[[bytes, ValueWithExpiration | None], None] | None = None,
    ) -> dict[bytes, ValueWithExpiration | None]:
        """Finds the values of serialized keys (`Retriever.get_many`)."""
        return await self._retriever.get_many(raw_keys, latest=latest, timeout=timeout, on_result=on_result)

    def holds_replica(self, key: bytes) -> bool:
        """Whether this node is one of the `num_replicas` nodes nearest to the 32-byte `key` that
        its routing table knows: the nodes a store's first round writes to (`StoreOperation.targets`
        takes this node in by the same rule), so in a swarm whose writers know the same nearest
        nodes, every writer's store of `key` reaches this node's storage. Never in client mode."""
        if self.client_mode:
            return False
        key_id = DHTID.from_bytes(key)
        replicas = self.config.num_replicas
        nearest = self.routing_table.get_nearest_neighbors(key_id, self.config.bucket_size)
        diversity = self.config.diversity
        chosen = nearest[:replicas] if diversity is None else diversity.pick(nearest, replicas)
        return len(chosen) < replicas or self.node_id ^ key_id < chosen[-1].node_id ^ key_id

    # -- upkeep (§2.3 refresh, §2.5 republish) -----------------------------------------------------

    async def _refresh_loop(self) -> None:
        interval = self.config.refresh_interval
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            await self.refresh()

    async def refresh(self) -> None:
        """Looks up a random ID in every bucket nobody touched for `refresh_interval` (§2.3).

        The bucket holding this node's own ID (its nearest neighbours, who hold the records it
        replicates) gets a full lookup; the others a cheap one (`_refresh_lookup`).
        """
        self.storage.remove_outdated()
        if self.cache is not None:
            self.cache.remove_outdated()
        ids = self.routing_table.buckets_to_refresh(time.time(), self.config.refresh_interval)
        own = [i for i in ids if self.routing_table.bucket_of(i).has_in_range(self.node_id)]
        far = [i for i in ids if i not in own]
        await asyncio.gather(
            *([self.find_nearest_nodes(own)] if own else []), *([self._refresh_lookup(far)] if far else []),
        )

    async def _republish_loop(self) -> None:
        interval = self.config.republish_interval
        await asyncio.sleep(interval * random.uniform(0.5, 1.0))  # random phase: replicas take turns (§2.5)
        while True:
            await self.republish()
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))

    async def republish(self) -> list[StoreOutcome]:
        """Sends records again to the nodes now nearest to their keys (§2.5).

        Records a store arrived for within `republish_interval` are skipped (another node
        republished them); records this node wrote itself are always sent until they expire.
        """
        now = get_dht_time()
        cutoff = time.time() - self.config.republish_interval
        records: dict[tuple[bytes, bytes], DHTRecord] = {}
        for key in self.storage.live_keys():
            received = self.storage.last_received(key)
            if received is not None and received > cutoff:
                continue
            for record in stored_records(self.storage, key):
                records[key, record.subkey] = record
        for ident, record in list(self.published.items()):
            if record.expiration_time <= now:
                del self.published[ident]
            else:
                records.setdefault(ident, record)
        if not records:
            return []
        return await self.store_many(list(records.values()), republish=False)
