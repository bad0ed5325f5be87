"""Storing records on the nodes nearest to their keys (Kademlia §2.3 STORE, §2.5 replication).

The lookup of a key's `num_replicas` nearest nodes and the stores overlap: the nodes this node
already knows to be nearest get the records in its first round of requests, a Store that also
asks for their nearest nodes (a Find in all but name). In a settled network they are the nearest
there are, and a store takes one round trip and `num_replicas` requests; nearer nodes the lookup
turns up get the records when it ends. This node keeps a replica itself when it is one of the
nearest (never in client mode).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from swarm.core.timeutil import get_dht_time
from swarm.dht.protocol import OUTDATED, STORED, StoreResult, store_item
from swarm.dht.routing import DHTID, NodeInfo
from swarm.dht.traversal import LookupResult
from swarm.dht.validation import DHTRecord
from swarm.proto import dht_pb2

if TYPE_CHECKING:
    from swarm.dht.node import DHTNode

T = TypeVar("T")


@dataclass
class StoreOutcome:
    """What became of one record sent to the DHT.

    Attributes:
        stored: Nodes that stored it (this one included).
        kept_here: This node stored a replica itself.
        outdated: Nodes that already held a value expiring as late or later.
        rejected: `PeerID: reason` for each node whose validators refused it.
        unanswered: Nodes that did not answer.
    """

    stored: int = 0
    kept_here: bool = False
    outdated: int = 0
    rejected: list[str] = field(default_factory=list)
    unanswered: int = 0

    def __bool__(self) -> bool:
        return self.stored > 0



BATCH_BYTES = 4 << 20
"""Most value bytes in one Store request (the transport caps messages at 8 MiB)."""


def chunks(items: Sequence[T], sizes: Sequence[int], max_items: int) -> list[list[T]]:
    """`items` cut into batches of at most `max_items` and `BATCH_BYTES` (a bigger item goes alone)."""
    batches: list[list[T]] = []
    current: list[T] = []
    total = 0
    for item, size in zip(items, sizes):
        if current and (len(current) >= max_items or total + size > BATCH_BYTES):
            batches.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    if current:
        batches.append(current)
    return batches


async def _maybe(call: Awaitable[T] | None) -> T | None:
    return None if call is None else await call


class Replicator:
    """Runs a node's stores (see the module docstring)."""

    def __init__(self, node: DHTNode) -> None:
        self.node = node
        self.config = node.config
        self.protocol = node.protocol
        self.routing_table = node.routing_table
        self.storage = node.storage
        self.stats = node.stats
        self.node_id = node.node_id
        self.client_mode = node.client_mode

    async def store_many(
        self,
        records: Sequence[DHTRecord],
        *,
        timeout: float | None = None,
        on_result: Callable[[int, StoreOutcome], None] | None = None,
        republish: bool = True,
    ) -> list[StoreOutcome]:
        """Stores each record on the `num_replicas` nodes nearest to its key.

        Args:
            records: Signed, validated records, each with its original key (`raw_key`).
            timeout: Deadline of the whole operation (default `lookup_timeout`).
            on_result: Called with (index, outcome) as soon as each record's fate is known.
            republish: Republish these records until they expire (this node wrote them).

        Returns:
            The outcome of each record, in order.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.lookup_timeout if timeout is None else timeout)
        now = get_dht_time()
        replicas = self.config.num_replicas
        outcomes = [StoreOutcome() for _ in records]
        pending = [0] * len(records)
        by_key: dict[DHTID, list[int]] = {}
        for index, record in enumerate(records):
            if record.raw_key is None:
                raise ValueError("records are stored with their original key (raw_key)")
            if record.expiration_time <= now:
                if on_result is not None:
                    on_result(index, outcomes[index])
                continue
            by_key.setdefault(DHTID.from_bytes(record.key), []).append(index)
            if republish:
                self.node.published[record.key, record.subkey] = record
        if not by_key:
            return outcomes
        items: dict[int, dht_pb2.DHTStoreItem] = {}

        def item(index: int) -> dht_pb2.DHTStoreItem:  # built once, sent to every replica
            built = items.get(index)
            if built is None:
                built = items[index] = store_item(records[index])
            return built

        sent: dict[DHTID, set[DHTID]] = {key_id: set() for key_id in by_key}
        first_round: dict[DHTID, set[DHTID]] = {}
        sends: set[asyncio.Task[list[StoreResult] | None]] = set()

        def settle(index: int) -> None:
            pending[index] -= 1
            if pending[index] == 0 and on_result is not None:
                on_result(index, outcomes[index])

        def account(node: NodeInfo, indices: list[int], answers: list[StoreResult] | None) -> None:
            for position, index in enumerate(indices):
                outcome = outcomes[index]
                if answers is None:
                    outcome.unanswered += 1
                elif answers[position].status == STORED:
                    outcome.stored += 1
                elif answers[position].status == OUTDATED:
                    outcome.outdated += 1
                else:
                    outcome.rejected.append(f"{node.peer_id}: {answers[position].reason}")
                settle(index)

        def targets(key_id: DHTID, nearest: list[NodeInfo]) -> list[NodeInfo]:
            """The nodes that should hold the key; keeps a replica here if this node is one of them."""
            chosen = nearest[:replicas]
            if not self.client_mode and (
                len(chosen) < replicas or self.node_id ^ key_id < chosen[-1].node_id ^ key_id
            ):
                chosen = chosen[: replicas - 1]
                if self.node_id not in sent[key_id]:  # this node's own ID in `sent` marks "kept here"
                    sent[key_id].add(self.node_id)
                    for index in by_key[key_id]:
                        self._store_locally(records[index], outcomes[index])
            return chosen

        for key_id, indices in by_key.items():
            for index in indices:
                pending[index] = 1  # the lookup's share, settled when the key's lookup ends
            nearest = self.routing_table.get_nearest_neighbors(key_id, replicas)
            first_round[key_id] = {node.node_id for node in targets(key_id, nearest)}
        count = min(2 * replicas, self.config.bucket_size)

        async def ask(node: NodeInfo, keys: list[DHTID]) -> dict[DHTID, list[NodeInfo]] | None:
            store_keys, budget = [], BATCH_BYTES
            for key_id in keys:  # records past the byte budget are sent once the lookup ends
                if node.node_id in first_round[key_id] and node.node_id not in sent[key_id]:
                    size = sum(len(records[index].value) for index in by_key[key_id])
                    if size <= budget or budget == BATCH_BYTES:
                        store_keys.append(key_id)
                        budget -= size
            find_keys = [k for k in keys if k not in store_keys]
            indices = [index for key_id in store_keys for index in by_key[key_id]]
            for key_id in store_keys:
                sent[key_id].add(node.node_id)
            for index in indices:
                pending[index] += 1
            # the store is owned by store_many, not by the lookup: it completes (and is accounted
            # for) even if the lookup ends without waiting for this node's answer
            store = start(send(node, indices, count)) if indices else None
            finds = self.protocol.call_find(node, find_keys, nodes_only=True, count=count) if find_keys else None
            stored, found = await asyncio.gather(_maybe(store and asyncio.shield(store)), _maybe(finds))
            if (indices and stored is None) or (find_keys and found is None):
                return None
            answer: dict[DHTID, list[NodeInfo]] = {}
            if stored is not None:
                for position, index in enumerate(indices):
                    answer.setdefault(DHTID.from_bytes(records[index].key), stored[position].nearest)
            if found is not None:
                answer.update((key_id, found_answer.nearest) for key_id, found_answer in found.items())
            return answer

        async def send(node: NodeInfo, indices: list[int], count: int = 0) -> list[StoreResult] | None:
            answers = None
            try:
                answers = await self.protocol.call_store(node, [item(i) for i in indices], count)
                return answers
            finally:
                account(node, indices, answers)

        def start(coro: Coroutine[Any, Any, list[StoreResult] | None]) -> asyncio.Task[list[StoreResult] | None]:
            task = asyncio.ensure_future(coro)
            sends.add(task)
            task.add_done_callback(sends.discard)
            return task

        def finished(results: list[tuple[DHTID, LookupResult]]) -> None:
            batches: dict[DHTID, tuple[NodeInfo, list[int]]] = {}
            for key_id, result in results:
                self.stats.record(result.hops, result.requests, timed_out=result.timed_out)
                for target in targets(key_id, result.nearest):
                    if target.node_id in sent[key_id]:
                        continue
                    sent[key_id].add(target.node_id)
                    batch = batches.get(target.node_id)
                    if batch is None:
                        batch = batches[target.node_id] = (target, [])
                    batch[1].extend(by_key[key_id])
                    for index in by_key[key_id]:
                        pending[index] += 1
            for target, indices in batches.values():
                sizes = [len(records[index].value) for index in indices]
                for chunk in chunks(indices, sizes, self.config.max_keys_per_call):
                    start(send(target, chunk))
            for key_id, _ in results:
                for index in by_key[key_id]:
                    settle(index)

        # the whole beam is asked at once: its first candidates are known from the start
        traversal = self.node.lookup(list(by_key), ask, replicas, finished, alpha=max(self.config.alpha, replicas))
        try:
            await traversal.run(max(0.0, deadline - loop.time()))
            while sends and loop.time() < deadline:
                await asyncio.wait(list(sends), timeout=max(0.0, deadline - loop.time()))
        finally:
            for task in list(sends):
                task.cancel()
            if sends:
                await asyncio.gather(*sends, return_exceptions=True)
        return outcomes

    def _store_locally(self, record: DHTRecord, outcome: StoreOutcome) -> None:
        if self.storage.store(record.key, record.value, record.expiration_time, record.subkey or None, record.raw_key):
            outcome.stored += 1
            outcome.kept_here = True
        else:
            self.storage.mark_received(record.key, record.raw_key)
            outcome.outdated += 1
