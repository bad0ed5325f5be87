"""Kademlia's routing table: the k-buckets of one node, split on demand.

Pure data, no networking: the protocol layer feeds it every node it hears from
(`RoutingTable.add_or_update`), pings the node it returns when a bucket is full, and asks it
for the nodes nearest to a key (`get_nearest_neighbors`). Node IDs and XOR distance live in
`ids.py`, k-buckets and node entries in `buckets.py`, the blacklist of silent peers in
`blacklist.py`; they are re-exported here. Section numbers in comments refer to Maymounkov &
Mazières, "Kademlia: A Peer-to-peer Information System Based on the XOR Metric" (IPTPS 2002).
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections.abc import Callable, Collection, Iterator

from swarm.dht.buckets import KBucket, NodeInfo
from swarm.dht.diversity import PrefixDiversity
from swarm.dht.ids import DHTID, ID_BITS, ID_SPACE

__all__ = ["RoutingTable"]


class RoutingTable:
    """The k-buckets of one node, split on demand (§2.2, §4.2).

    Args:
        node_id: This node's ID; it is never stored in its own table.
        bucket_size: k, the most active nodes per bucket (the paper's k = 20).
        depth_modulo: b in §4.2's relaxed splitting rule: a full bucket that does not hold
            our own ID still splits while its depth is not a multiple of `depth_modulo`, so
            the table keeps more contacts near distant IDs and lookups take fewer hops.
        clock: Time source for bucket freshness (§2.3 refresh).
        diversity: At most so many contacts per network prefix, per common ID prefix length
            with this node and in all (`swarm.dht.diversity`); a node past it is not added.
            None: no limit.
    """

    def __init__(
        self,
        node_id: DHTID,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        clock: Callable[[], float] = time.time,
        diversity: PrefixDiversity | None = None,
    ) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        if depth_modulo < 1:
            raise ValueError(f"depth_modulo must be >= 1, got {depth_modulo}")
        self.node_id = DHTID(node_id)
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self._clock = clock
        self.buckets: list[KBucket] = [KBucket(0, ID_SPACE, bucket_size, clock())]
        self._lowers: list[int] = [0]  # bucket lower bounds, sorted, for bisect
        self._nodes: dict[DHTID, NodeInfo] = {}  # active nodes of every bucket
        self._by_peer: dict[str, DHTID] = {}
        self.diversity = diversity
        self._by_prefix: dict[str, int] = {}  # active contacts per network prefix
        self._by_depth_prefix: dict[tuple[int, str], int] = {}  # per (common ID prefix length, network)
        self.refused_for_diversity = 0
        """Nodes not added because their network had its share (a Sybil defence)."""

    def _bucket_index(self, node_id: int) -> int:
        return bisect.bisect_right(self._lowers, node_id) - 1

    def _index(self, node: NodeInfo) -> None:
        old = self._nodes.get(node.node_id)
        if old is not None and old.peer_id != node.peer_id:
            self._by_peer.pop(old.peer_id, None)
        if old is not None:
            self._count(old, -1)
        self._nodes[node.node_id] = node
        self._by_peer[node.peer_id] = node.node_id
        self._count(node, 1)

    def _unindex(self, node_id: DHTID) -> None:
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._count(node, -1)
            if self._by_peer.get(node.peer_id) == node_id:
                del self._by_peer[node.peer_id]

    def _count(self, node: NodeInfo, delta: int) -> None:
        if self.diversity is None:
            return
        prefix = self.diversity.prefix_of(node.addr)
        if prefix:
            _add(self._by_prefix, prefix, delta)
            _add(self._by_depth_prefix, (self._common_bits(node.node_id), prefix), delta)

    def _common_bits(self, node_id: int) -> int:
        return ID_BITS - (node_id ^ self.node_id).bit_length()

    def _too_many_from(self, node: NodeInfo) -> bool:
        """Whether the node's network has its share of contacts already (it is not one of them)."""
        diversity = self.diversity
        if diversity is None:
            return False
        known = self._nodes.get(node.node_id)
        prefix = diversity.prefix_of(node.addr)
        if not prefix or (known is not None and diversity.prefix_of(known.addr) == prefix):
            return False
        return (self._by_prefix.get(prefix, 0) >= diversity.per_table
                or self._by_depth_prefix.get((self._common_bits(node.node_id), prefix), 0) >= diversity.per_bucket)

    def add_or_update(self, node_id: int, peer_id: str, addr: str) -> NodeInfo | None:
        """Records that a node was heard from (every request or reply updates the table, §2.2).

        Returns:
            None when the node is now in the table (or is ourselves). When its bucket is full
            and may not split, the node waits in the replacement cache and the least-recently
            seen active node is returned: the caller should ping it and `remove` it if it does
            not answer, which promotes a cached node (§2.2: old live nodes are preferred).
        """
        node_id = DHTID(node_id)
        if node_id == self.node_id:
            return None
        node = NodeInfo(node_id, peer_id, addr)
        if self._too_many_from(node):
            self.refused_for_diversity += 1
            return None
        previous = self._by_peer.get(peer_id)
        if previous is not None and previous != node_id:
            self.remove(previous)  # a PeerID maps to one node ID; keep the latest claim
        while True:
            index = self._bucket_index(node_id)
            bucket = self.buckets[index]
            if bucket.add_or_update(node, self._clock()):
                self._index(node)
                return None
            # §4.2: split the bucket holding our own ID; relaxed: also split while the depth
            # is not a multiple of depth_modulo, for an irregular table of ~b-bit prefixes.
            if bucket.has_in_range(self.node_id) or bucket.depth % self.depth_modulo != 0:
                self._split(index)
                continue
            return bucket.least_recently_seen()

    def _split(self, index: int) -> None:
        left, right = self.buckets[index].split()
        self.buckets[index : index + 1] = [left, right]
        self._lowers[index : index + 1] = [left.lower, right.lower]
        for child in (left, right):
            for node in list(child.nodes.values()):  # a split may promote cached nodes
                if node.node_id not in self._nodes and self._too_many_from(node):
                    del child.nodes[node.node_id]  # its network got its share while it waited
                    continue
                self._index(node)

    def remove(self, node_id: int) -> NodeInfo | None:
        """Removes a node (it failed to answer); promotes a cached one in its place (§4.1).

        Returns:
            The node promoted from the replacement cache, if any.
        """
        node_id = DHTID(node_id)
        self._unindex(node_id)
        bucket = self.buckets[self._bucket_index(node_id)]
        promoted = bucket.remove(node_id)
        while promoted is not None and self._too_many_from(promoted):  # its network got its share meanwhile
            del bucket.nodes[promoted.node_id]
            promoted = None
            if bucket.replacements:  # the next freshest cached node, as `KBucket.remove` would (§4.1)
                _, promoted = bucket.replacements.popitem(last=True)
                bucket.nodes[promoted.node_id] = promoted
        if promoted is not None:
            self._index(promoted)
        return promoted

    def get(self, *, node_id: int | None = None, peer_id: str | None = None) -> NodeInfo | None:
        """Looks up an active node by node ID or by PeerID (exactly one of them)."""
        if (node_id is None) == (peer_id is None):
            raise TypeError("give exactly one of node_id, peer_id")
        if peer_id is not None:
            found = self._by_peer.get(peer_id)
            return None if found is None else self._nodes[found]
        return self._nodes.get(DHTID(node_id))  # type: ignore[arg-type]

    def get_nearest_neighbors(
        self, query_id: int, k: int, exclude: int | Collection[int] | None = None
    ) -> list[NodeInfo]:
        """The up to `k` active nodes closest to `query_id` by XOR distance, nearest first (§2.3).

        Args:
            query_id: A node ID or key ID.
            k: How many nodes to return at most.
            exclude: A node ID or node IDs to leave out (for example, the requester).
        """
        if k <= 0:
            return []
        if exclude is None:
            excluded: Collection[int] = ()
        elif isinstance(exclude, int):
            excluded = (exclude,)
        else:
            excluded = exclude if isinstance(exclude, set | frozenset) else set(exclude)
        query = int(query_id)
        # heapq.nsmallest is O(n log k): ~1 ms for thousands of nodes, far below a network hop.
        candidates = (node for node in self._nodes.values() if node.node_id not in excluded)
        return heapq.nsmallest(k, candidates, key=lambda node: node.node_id ^ query)

    def bucket_of(self, node_id: int) -> KBucket:
        """The bucket whose range holds `node_id`."""
        return self.buckets[self._bucket_index(node_id)]

    def buckets_to_refresh(
        self, now: float, interval: float, rng: random.Random | None = None
    ) -> list[DHTID]:
        """A random ID in each bucket not touched for `interval` seconds (§2.3 bucket refresh).

        The caller looks each ID up (`find_node`); every node heard from on the way touches
        its bucket.
        """
        return [
            DHTID.generate(bucket.lower, bucket.upper, rng)
            for bucket in self.buckets
            if now - bucket.last_updated >= interval
        ]

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, int) and node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeInfo]:
        return iter(list(self._nodes.values()))

    def __repr__(self) -> str:
        return f"RoutingTable(node_id={self.node_id!r}, nodes={len(self)}, buckets={len(self.buckets)})"


def _add(counts: dict, key: object, delta: int) -> None:
    left = counts.get(key, 0) + delta
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
