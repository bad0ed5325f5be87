"""Kademlia's routing table: node IDs, XOR distance, k-buckets, and a blacklist of silent peers.

Pure data, no networking: the protocol layer feeds it every node it hears from
(`RoutingTable.add_or_update`), pings the node it returns when a bucket is full, and asks it
for the nodes nearest to a key (`get_nearest_neighbors`). Section numbers in comments refer
to Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information System Based on the XOR
Metric" (IPTPS 2002).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.core.identity import peer_id_to_bytes
from swarm.dht.keys import Key, key_to_bytes

if TYPE_CHECKING:
    from typing import Self

ID_BITS = 256
"""Width of a DHTID: node IDs and keys are sha256 digests."""
ID_BYTES = ID_BITS // 8
_ID_SPACE = 1 << ID_BITS


class DHTID(int):
    """A 256-bit Kademlia identifier for a node or a key (§2: "160-bit" there, sha256 here)."""

    MIN = 0
    MAX = _ID_SPACE  # exclusive

    def __new__(cls, value: int) -> Self:
        if not 0 <= value < _ID_SPACE:
            raise ValueError(f"a DHTID is in [0, 2**{ID_BITS}), got {value}")
        return super().__new__(cls, value)

    @classmethod
    def from_peer_id(cls, peer_id: str) -> DHTID:
        """The node ID of a peer: sha256 of its binary PeerID (the multihash)."""
        return cls(int.from_bytes(hashlib.sha256(peer_id_to_bytes(peer_id)).digest(), "big"))

    @classmethod
    def from_key(cls, key: Key) -> DHTID:
        """The ID of a data key: sha256 of the key's msgpack form (`swarm.dht.keys`)."""
        return cls(int.from_bytes(key_to_bytes(key), "big"))

    @classmethod
    def generate(cls, lower: int = 0, upper: int = _ID_SPACE, rng: random.Random | None = None) -> DHTID:
        """A uniformly random ID in [lower, upper) (random node IDs, bucket refresh)."""
        if not 0 <= lower < upper <= _ID_SPACE:
            raise ValueError(f"empty or out-of-space range [{lower}, {upper})")
        return cls((rng or random).randrange(lower, upper))

    def to_bytes(  # type: ignore[override]
        self, length: int = ID_BYTES, byteorder: str = "big", *, signed: bool = False
    ) -> bytes:
        """The 32-byte big-endian form used on the wire and as a storage key."""
        return int(self).to_bytes(length, byteorder, signed=signed)  # type: ignore[arg-type]

    @classmethod
    def from_bytes(  # type: ignore[override]
        cls, raw: bytes, byteorder: str = "big", *, signed: bool = False
    ) -> DHTID:
        """Parses `to_bytes` output.

        Raises:
            ValueError: `raw` is not exactly 32 bytes.
        """
        if len(raw) != ID_BYTES:
            raise ValueError(f"a DHTID is {ID_BYTES} bytes, got {len(raw)}")
        return cls(int.from_bytes(raw, byteorder, signed=signed))  # type: ignore[arg-type]

    def xor_distance(self, other: int) -> int:
        """Kademlia's distance d(x, y) = x XOR y (§2.1)."""
        return int(self) ^ int(other)

    def __repr__(self) -> str:
        return f"DHTID({int(self):#066x})"


def xor_distance(a: int, b: int) -> int:
    """Kademlia's distance d(a, b) = a XOR b (§2.1): symmetric, and unidirectional."""
    return int(a) ^ int(b)


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
        if not 0 <= lower < upper <= _ID_SPACE:
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


class RoutingTable:
    """The k-buckets of one node, split on demand (§2.2, §4.2).

    Args:
        node_id: This node's ID; it is never stored in its own table.
        bucket_size: k, the most active nodes per bucket (the paper's k = 20).
        depth_modulo: b in §4.2's relaxed splitting rule: a full bucket that does not hold
            our own ID still splits while its depth is not a multiple of `depth_modulo`, so
            the table keeps more contacts near distant IDs and lookups take fewer hops.
        clock: Time source for bucket freshness (§2.3 refresh).
    """

    def __init__(
        self,
        node_id: DHTID,
        bucket_size: int = 20,
        depth_modulo: int = 5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        if depth_modulo < 1:
            raise ValueError(f"depth_modulo must be >= 1, got {depth_modulo}")
        self.node_id = DHTID(node_id)
        self.bucket_size = bucket_size
        self.depth_modulo = depth_modulo
        self._clock = clock
        self.buckets: list[KBucket] = [KBucket(0, _ID_SPACE, bucket_size, clock())]
        self._lowers: list[int] = [0]  # bucket lower bounds, sorted, for bisect
        self._nodes: dict[DHTID, NodeInfo] = {}  # active nodes of every bucket
        self._by_peer: dict[str, DHTID] = {}

    def _bucket_index(self, node_id: int) -> int:
        return bisect.bisect_right(self._lowers, node_id) - 1

    def _index(self, node: NodeInfo) -> None:
        old = self._nodes.get(node.node_id)
        if old is not None and old.peer_id != node.peer_id:
            self._by_peer.pop(old.peer_id, None)
        self._nodes[node.node_id] = node
        self._by_peer[node.peer_id] = node.node_id

    def _unindex(self, node_id: DHTID) -> None:
        node = self._nodes.pop(node_id, None)
        if node is not None and self._by_peer.get(node.peer_id) == node_id:
            del self._by_peer[node.peer_id]

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
            for node in child.nodes.values():  # a split may promote cached nodes
                self._index(node)

    def remove(self, node_id: int) -> NodeInfo | None:
        """Removes a node (it failed to answer); promotes a cached one in its place (§4.1).

        Returns:
            The node promoted from the replacement cache, if any.
        """
        node_id = DHTID(node_id)
        self._unindex(node_id)
        promoted = self.buckets[self._bucket_index(node_id)].remove(node_id)
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


class Blacklist:
    """Peers that failed to answer, banned for exponentially growing periods.

    The n-th consecutive failure bans a peer for `base_time * backoff_rate ** (n - 1)`
    seconds (capped at `max_time`). Failures reported while a peer is already banned do not
    count again: many calls failing in one outage are one failure. A success clears the peer,
    and so does staying unreported for `max_time` after a ban ends.

    Args:
        base_time: Ban after the first failure, in seconds.
        backoff_rate: Factor by which each further failure lengthens the ban.
        max_time: Longest ban, in seconds.
        clock: Time source.
    """

    _PRUNE_AT = 4096  # entries before long-expired ones are dropped

    def __init__(
        self,
        base_time: float = 5.0,
        backoff_rate: float = 2.0,
        max_time: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if base_time <= 0 or backoff_rate < 1 or max_time < base_time:
            raise ValueError(
                f"need base_time > 0, backoff_rate >= 1, max_time >= base_time; got "
                f"{base_time}, {backoff_rate}, {max_time}"
            )
        self.base_time = base_time
        self.backoff_rate = backoff_rate
        self.max_time = max_time
        self._clock = clock
        self._failures: dict[str, int] = {}
        self._banned_until: dict[str, float] = {}

    def register_failure(self, peer_id: str) -> None:
        """Records that `peer_id` did not answer; bans it (longer each time)."""
        now = self._clock()
        until = self._banned_until.get(peer_id)
        if until is not None and until > now:
            return
        if until is not None and now - until > self.max_time:
            self._failures.pop(peer_id, None)  # quiet for long: start over from base_time
        if len(self._banned_until) > self._PRUNE_AT:
            self._forget_stale(now)
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        try:
            ban = min(self.base_time * self.backoff_rate ** (failures - 1), self.max_time)
        except OverflowError:
            ban = self.max_time
        self._banned_until[peer_id] = now + ban

    def _forget_stale(self, now: float) -> None:
        for peer_id, until in list(self._banned_until.items()):
            if now - until > self.max_time:
                del self._banned_until[peer_id]
                self._failures.pop(peer_id, None)

    def register_success(self, peer_id: str) -> None:
        """Records that `peer_id` answered: forgets its failures."""
        self._failures.pop(peer_id, None)
        self._banned_until.pop(peer_id, None)

    def is_banned(self, peer_id: str) -> bool:
        return self._banned_until.get(peer_id, float("-inf")) > self._clock()

    def banned_until(self, peer_id: str) -> float | None:
        """When the current ban of `peer_id` ends, or None if it is not banned."""
        until = self._banned_until.get(peer_id)
        return until if until is not None and until > self._clock() else None

    def clear(self) -> None:
        self._failures.clear()
        self._banned_until.clear()

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, str) and self.is_banned(peer_id)

    def __len__(self) -> int:
        """Number of peers banned right now."""
        now = self._clock()
        return sum(1 for until in self._banned_until.values() if until > now)
