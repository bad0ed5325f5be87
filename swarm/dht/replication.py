"""Storing records on the nodes nearest to their keys (Kademlia §2.3 STORE, §2.5 replication).

The lookup of a key's `num_replicas` nearest nodes and the stores overlap: the nodes this node
already knows to be nearest get the records first (the nearest of them first of all), in Stores
that also ask for their nearest nodes (a Find in all but name). In a settled network they are the nearest there are, their
answers name no nearer node, and a store takes one round trip and `num_replicas` requests; when
they do name one, the lookup goes on and the nearer nodes it turns up get the records when it
ends (`store_operation.py`). This node keeps a replica itself when it is one of the nearest
(never in client mode).

A store does not wait for every replica. A record's outcome is settled, and reported to the
caller, as soon as the nearest other node known to hold the key accepted it (the node any reader
asks first, so a get that follows finds the new value), or else once every node it was sent to
answered, or at the deadline. The other replicas complete in the background, in tasks the node
owns (cancelled at shutdown). A refusal is never settled early: a record reads as refused only
once every node has answered and none took it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from swarm.core.errors import DHTError
from swarm.core.timeutil import get_dht_time
from swarm.dht.context import NodeContext
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.storage import DHTLocalStorage
from swarm.dht.store_operation import StoreOperation
from swarm.dht.store_outcome import StoreOutcome
from swarm.dht.validation import DHTRecord


def stored_records(storage: DHTLocalStorage, key: bytes) -> list[DHTRecord]:
    """The records (one per subkey of a dictionary) under `key` in `storage`, ready to be sent
    again (empty if there is none, or its original key is unknown)."""
    raw_key = storage.raw_key(key)
    found = storage.get(key)
    if raw_key is None or found is None:
        return []
    if isinstance(found.value, DictionaryValue):
        return [DHTRecord(key, subkey, value, expiration, raw_key) for subkey, (value, expiration) in found.value.items()]
    return [DHTRecord(key, b"", found.value, found.expiration_time, raw_key)]


class Replicator:
    """Runs a node's stores (see the module docstring)."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.config = node.config
        self.protocol = node.protocol
        self.routing_table = node.routing_table
        self.storage = node.storage
        self.stats = node.stats
        self.node_id = node.node_id
        self.client_mode = node.client_mode
        self.in_flight: set[asyncio.Task[None]] = set()
        """Stores still running: the last replicas of stores that returned, being written."""

    async def store_many(
        self,
        records: Sequence[DHTRecord],
        *,
        timeout: float | None = None,
        on_result: Callable[[int, StoreOutcome], None] | None = None,
        republish: bool = True,
    ) -> list[StoreOutcome]:
        """Stores each record on the `num_replicas` nodes nearest to its key.

        Returns once every record's outcome is settled (see the module docstring); the replicas
        still in flight then complete in the background.

        Args:
            records: Signed, validated records, each with its original key (`raw_key`).
            timeout: Deadline of the whole operation (default `lookup_timeout`).
            on_result: Called with (index, outcome) as soon as each record's outcome is settled.
            republish: Republish these records until they expire (this node wrote them).

        Returns:
            The outcome of each record as it was settled, in order.

        Raises:
            DHTError: The node has shut down.
        """
        if self.node.closed:
            raise DHTError("the DHT node has shut down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.lookup_timeout if timeout is None else timeout)
        for record in records:
            if record.raw_key is None:
                raise ValueError("records are stored with their original key (raw_key)")
        store = StoreOperation(self.node, self.store_locally, records, on_result)
        if republish:
            now = get_dht_time()
            for record in records:
                if record.expiration_time > now:
                    self.node.published[record.key, record.subkey] = record
        if store.by_key:
            try:
                store.launch()  # the first round goes out now, before the lookup starts
            except BaseException:
                store.cancel()
                raise
            task = self.node.spawn(store.run(deadline), "dht-store")
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)
            try:
                await store.settled
            except asyncio.CancelledError:
                task.cancel()  # the caller gave up before every outcome was known
                store.cancel()
                raise
        return store.results()

    async def wait(self, timeout: float | None = None) -> bool:
        """Waits until the stores in flight have ended (every replica answered, or failed, or the
        store's deadline passed); True if none is left."""
        if self.in_flight:
            await asyncio.wait(list(self.in_flight), timeout=timeout)
        return not self.in_flight

    def store_locally(self, record: DHTRecord, outcome: StoreOutcome) -> None:
        if self.storage.store(record.key, record.value, record.expiration_time, record.subkey or None, record.raw_key):
            outcome.stored += 1
            outcome.kept_here = True
        else:
            self.storage.mark_received(record.key, record.raw_key)
            outcome.outdated += 1
