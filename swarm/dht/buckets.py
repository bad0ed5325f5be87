"""Kademlia's k-buckets (§2.2, §2.4, §4.1, §4.2) and the node entries they hold.

Pure data, no networking: `RoutingTable` (`routing.py`) keeps one `KBucket` per ID range. Section
numbers in comments refer to Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information System
Based on the XOR Metric" (IPTPS 2002).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from swarm.dht.ids import DHTID, ID_BITS, ID_SPACE


@dataclass(frozen=True)
class NodeInfo:
    """A node the table knows: its ID, its PeerID, and the multiaddr to reach it."""

    node_id: DHTID
    peer_id: str
    addr: str


class KBucket:
    """The nodes whose IDs fall in [lower, upper) (§2.2, §2.4).

    Active nodes are kept least-recently seen first, at most `size` of them; further nodes
    wait in a replacement cache of the same size, most-recently seen last (§4.1), and are
    promoted when an active node is removed.
    """

    def __init__(self, lower: int, upper: int, size: int, last_updated: float) -> None:
        if not 0 <= lower < upper <= ID_SPACE:
            raise ValueError(f"bad bucket range [{lower}, {upper})")
        self.lower = lower
        self.upper = upper
        self.size = size
        self.last_updated = last_updated
        self.nodes: OrderedDict[DHTID, NodeInfo] = OrderedDict()
        self.replacements: OrderedDict[DHTID, NodeInfo] = OrderedDict()

    @property
    def depth(self) -> int:
        """Length of the ID prefix all IDs in this bucket share (0 for the whole space)."""
        return ID_BITS - (self.upper - self.lower).bit_length() + 1

    def has_in_range(self, node_id: int) -> bool:
        return self.lower <= node_id < self.upper

    def is_full(self) -> bool:
        return len(self.nodes) >= self.size

    def least_recently_seen(self) -> NodeInfo | None:
        return next(iter(self.nodes.values()), None)

    def add_or_update(self, node: NodeInfo, now: float) -> bool:
        """Records that `node` was seen now.

        A known node moves to the tail (most recently seen) and takes the new address; a new
        one is appended while there is room (§2.2). Otherwise it goes to the replacement
        cache, evicting the stalest replacement, and the call returns False.
        """
        self.last_updated = now
        if node.node_id in self.nodes:
            self.nodes[node.node_id] = node
            self.nodes.move_to_end(node.node_id)
            return True
        if not self.is_full():
            self.replacements.pop(node.node_id, None)
            self.nodes[node.node_id] = node
            return True
        self.replacements[node.node_id] = node
        self.replacements.move_to_end(node.node_id)
        while len(self.replacements) > self.size:
            self.replacements.popitem(last=False)
        return False

    def remove(self, node_id: DHTID) -> NodeInfo | None:
        """Drops a node; an active one is replaced by the freshest cached node (§4.1).

        Returns:
            The promoted replacement, if any.
        """
        if self.replacements.pop(node_id, None) is not None:
            return None
        if self.nodes.pop(node_id, None) is None:
            return None
        if self.replacements:
            _, promoted = self.replacements.popitem(last=True)
            self.nodes[promoted.node_id] = promoted
            return promoted
        return None

    def split(self) -> tuple[KBucket, KBucket]:
        """Halves the range; nodes keep their order, active ones before cached ones (§4.2)."""
        middle = (self.lower + self.upper) // 2
        left = KBucket(self.lower, middle, self.size, self.last_updated)
        right = KBucket(middle, self.upper, self.size, self.last_updated)
        for node in (*self.nodes.values(), *self.replacements.values()):
            (left if node.node_id < middle else right).add_or_update(node, self.last_updated)
        return left, right

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"KBucket(depth={self.depth}, nodes={len(self.nodes)}, replacements={len(self.replacements)})"
