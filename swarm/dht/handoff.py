"""Handing records over to new nodes (Kademlia §2.3: "to store a key-value pair ... when a new node
joins", and §2.5).

A node that joins must come to hold the records it is now one of the nearest nodes of; the nodes
already there know which records those are. So when a node learns of a node it did not know
(`Contacts.on_new_node`), it sends the newcomer, in batched Stores, each record it holds for which:

- the newcomer is now one of the `num_replicas` nodes nearest to the key (the nodes that should
  hold it; swarm keeps records on `num_replicas` nodes rather than k), and
- this node is the nearest of the nodes that were there before (so one node hands each record
  over, not every replica).

The work is bounded: it runs only for nodes new to the routing table (not for every message), a
moment after they joined, one pass over the local records at a time for every newcomer that
arrived meanwhile, yielding to the event loop as it goes, and each newcomer gets its records in
batches, one after the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

from swarm.dht.batching import chunks
from swarm.dht.buckets import NodeInfo
from swarm.dht.context import NodeContext
from swarm.dht.ids import DHTID
from swarm.dht.replication import stored_records
from swarm.dht.wire import STORED, store_item

logger = logging.getLogger(__name__)

_YIELD_EVERY = 256  # records examined between two yields to the event loop
HANDOFF_DELAY = 0.5
"""Seconds between learning of a newcomer and handing it records: it finishes joining first, and
the newcomers of a burst (many nodes starting at once) share one pass over the records."""


def newcomers_to_serve(
    key_id: DHTID, own_id: DHTID, nearest: Sequence[NodeInfo], newcomers: Collection[DHTID], replicas: int
) -> list[NodeInfo]:
    """The newcomers this node should hand a key's record to (see the module docstring).

    Args:
        key_id: The record's key.
        own_id: This node's ID.
        nearest: The nodes of the routing table nearest to the key, nearest first, newcomers
            included: at least `replicas + len(newcomers)` of them where the table has as many.
        newcomers: IDs of the nodes new to the routing table.
        replicas: How many of the nearest nodes hold a record.
    """
    own = own_id ^ key_id
    served: list[NodeInfo] = []
    rank = 0  # place among every node, this one included
    ranked = False  # this node has taken its place
    for node in nearest:
        if ranked and rank >= replicas:
            break
        distance = node.node_id ^ key_id
        if not ranked and own < distance:
            ranked = True
            rank += 1
            if rank >= replicas:
                break
        if node.node_id in newcomers:
            if rank < replicas:
                served.append(node)
        elif not ranked:
            return []  # a node that was there before is nearer: it hands the record over
        rank += 1
    return served


class Handoff:
    """Hands a node's records over to the nodes that joined near their keys (see the module docstring)."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.handed_over = 0
        """Records sent to newcomers and stored by them (for monitoring and tests)."""
        self._newcomers: dict[DHTID, NodeInfo] = {}
        self._task: asyncio.Task[object] | None = None

    def welcome(self, newcomer: NodeInfo) -> None:
        """Called for each node new to the routing table: hands it its records soon."""
        if self.node.closed or not len(self.node.storage):
            return
        self._newcomers[newcomer.node_id] = newcomer
        if self._task is None:
            self._task = self.node.spawn(self._run(), "dht-handoff")

    async def _run(self) -> None:
        try:
            while self._newcomers:
                await asyncio.sleep(HANDOFF_DELAY)
                newcomers, self._newcomers = self._newcomers, {}
                table = self.node.routing_table
                newcomers = {node_id: node for node_id, node in newcomers.items() if node_id in table}  # not left
                chosen = await self._select(newcomers) if newcomers else {}
                await asyncio.gather(*(
                    self._hand_over(newcomers[node_id], keys) for node_id, keys in chosen.items() if keys
                ))
        finally:
            self._task = None

    async def _select(self, newcomers: dict[DHTID, NodeInfo]) -> dict[DHTID, list[bytes]]:
        """The keys of the records each newcomer should get from this node."""
        node = self.node
        width = node.config.num_replicas + len(newcomers)
        chosen: dict[DHTID, list[bytes]] = {node_id: [] for node_id in newcomers}
        for count, key in enumerate(node.storage.live_keys()):
            if count % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)  # a big storage must not stall the node's other work
            key_id = DHTID.from_bytes(key)
            nearest = node.routing_table.get_nearest_neighbors(key_id, width)
            for newcomer in newcomers_to_serve(key_id, node.node_id, nearest, newcomers, node.config.num_replicas):
                chosen[newcomer.node_id].append(key)
        return chosen

    async def _hand_over(self, newcomer: NodeInfo, keys: list[bytes]) -> None:
        items = [store_item(record) for key in keys for record in stored_records(self.node.storage, key)]
        sizes = [len(item.value) for item in items]
        for chunk in chunks(items, sizes, self.node.config.max_keys_per_call):
            answers = await self.node.protocol.call_store(newcomer, chunk)
            if answers is None:
                return  # it left or cannot be reached: the rest would fail too
            self.handed_over += sum(answer.status == STORED for answer in answers)
        logger.debug("handed %d records over to %s", len(items), newcomer.peer_id)
