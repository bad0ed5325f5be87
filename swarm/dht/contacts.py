"""Keeping the routing table in step with the traffic (Kademlia §2.2).

Every message teaches a node about its peer: a request about the caller (when it named an
address), an answer about the callee. `Contacts` turns these into routing-table updates:

- a node heard from is added or moved to the tail of its bucket; when its bucket is full, the
  least-recently seen contact is pinged and replaced only if it is gone (§2.2: old live nodes are
  preferred);
- a node seen for the first time is announced to `on_new_node` (the node hands it the records it
  should now hold, `handoff.py`);
- a call that failed is an expected event, logged at debug level: a callee that refused the
  connection, or keeps timing out, is dropped and blacklisted with growing bans;
- a node that says it is leaving (the Leave RPC) is dropped at once, and what is heard from it
  in the next moments (answers to calls already in flight) does not bring it back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from swarm.core.errors import DeadlineExceeded, PeerUnreachable, RPCError, Unauthenticated
from swarm.core.loop import spawn
from swarm.dht.blacklist import Blacklist
from swarm.dht.buckets import NodeInfo
from swarm.dht.ids import DHTID
from swarm.dht.routing import RoutingTable
from swarm.dht.wire import CACHE_LIMIT, node_id_of

logger = logging.getLogger(__name__)

TIMEOUTS_TO_DROP = 3
"""Timeouts in a row after which a node counts as gone."""
RECHECK_AFTER = 30.0
"""Seconds during which a contact that answered a liveness check is not checked again."""
DEPARTED_GRACE = 5.0
"""Seconds during which a node that said it is leaving is not added back (it may still answer
calls already in flight while it shuts down); a node that comes back later is added as usual."""


class Contacts:
    """The routing-table upkeep of one node (see the module docstring).

    Args:
        routing_table: This node's k-buckets.
        blacklist: Peers that failed to answer.
        ping: Pings a node, True if it answered (to check the stalest contact of a full bucket).
    """

    def __init__(
        self, routing_table: RoutingTable, blacklist: Blacklist, ping: Callable[[NodeInfo], Awaitable[bool]]
    ) -> None:
        self.routing_table = routing_table
        self.blacklist = blacklist
        self._ping = ping
        self.on_new_node: Callable[[NodeInfo], None] | None = None
        """Called with each node that enters the routing table for the first time (or again after
        it was dropped)."""
        self.failures: Counter[str] = Counter()
        """Calls that failed, by method path (for monitoring and tests)."""
        self.pinging: set[DHTID] = set()
        """Contacts being checked right now."""
        self.checked: dict[DHTID, float] = {}
        """When each contact was last checked (monotonic seconds)."""
        self._timeouts: dict[str, int] = {}  # consecutive timeouts per peer
        self._last_timeout = -math.inf  # monotonic time of the last call that timed out
        self._departed: dict[str, float] = {}  # peer -> monotonic time until which it stays out
        self._closed = False
        self._tasks: set[asyncio.Task[object]] = set()

    async def close(self) -> None:
        """Stops the liveness checks in flight (and starts no more)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def heard_from(self, node: NodeInfo) -> None:
        """Records that `node` is alive; pings the stalest contact of its bucket if that is full."""
        if self.blacklist.is_banned(node.peer_id):
            return
        if self._departed and self._has_departed(node.peer_id):
            return
        table = self.routing_table
        known = node.node_id in table
        stale = table.add_or_update(node.node_id, node.peer_id, node.addr)
        if not known and self.on_new_node is not None and node.node_id in table:
            self.on_new_node(node)
        if stale is None or stale.node_id in self.pinging or self._closed:
            return
        now = time.monotonic()
        if now - self.checked.get(stale.node_id, -math.inf) < RECHECK_AFTER:
            return  # it answered a check a moment ago: keep it, and the newcomer waits in the cache
        if len(self.checked) > CACHE_LIMIT:
            self.checked.clear()
        self.checked[stale.node_id] = now
        self.pinging.add(stale.node_id)
        task = spawn(self._check_stale(stale), name=f"dht-ping-stale-{stale.peer_id[-8:]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check_stale(self, node: NodeInfo) -> None:
        try:
            await self._ping(node)  # on failure, `failed` removes it and a cached node takes its place
        finally:
            self.pinging.discard(node.node_id)

    def answered(self, node: NodeInfo) -> None:
        """Records that `node` answered a call."""
        if self._timeouts:
            self._timeouts.pop(node.peer_id, None)
        self.blacklist.register_success(node.peer_id)
        self.heard_from(node)

    def failed(self, node: NodeInfo, error: RPCError, method: str) -> None:
        """Drops and bans a node that is gone, or is not who it claimed, or keeps timing out.

        A refused connection is proof enough; a timeout is not (a lost packet, a busy peer), so
        a node is dropped after `TIMEOUTS_TO_DROP` timeouts in a row (§4.1 tolerates a few).
        """
        self.failures[method] += 1
        logger.debug("DHT %s to %s failed: %s", method.rsplit("/", 1)[-1], node.peer_id, error)
        if isinstance(error, DeadlineExceeded):
            self._last_timeout = time.monotonic()
            strikes = self._timeouts.get(node.peer_id, 0) + 1
            if strikes < TIMEOUTS_TO_DROP:
                if len(self._timeouts) > CACHE_LIMIT:
                    self._timeouts.clear()
                self._timeouts[node.peer_id] = strikes
                return
        if isinstance(error, (PeerUnreachable, DeadlineExceeded, Unauthenticated)):
            self._timeouts.pop(node.peer_id, None)
            self.blacklist.register_failure(node.peer_id)
            self.routing_table.remove(node.node_id)

    def timeouts_in_a_row(self, node: NodeInfo) -> int:
        """How many of `node`'s calls in a row timed out (0 once it answers again)."""
        return self._timeouts.get(node.peer_id, 0)

    def timed_out_within(self, seconds: float) -> bool:
        """Whether a call of this peer to some node timed out in the last `seconds` (a node
        dropped since counts: peers that have not met it yet may still wait on it)."""
        return time.monotonic() - self._last_timeout <= seconds

    def is_suspect(self, peer_id: str) -> bool:
        """Whether this peer's last call to `peer_id` timed out and it has not answered since
        (a lookup asks it but does not wait for it: `swarm.dht.traversal`)."""
        return peer_id in self._timeouts

    def unusable(self, node: NodeInfo) -> None:
        """Drops a node whose address cannot be dialled."""
        self.routing_table.remove(node.node_id)

    def departed(self, peer_id: str) -> None:
        """Drops a node that said it is leaving; it is not added back for `DEPARTED_GRACE` seconds."""
        now = time.monotonic()
        if len(self._departed) > CACHE_LIMIT:
            self._departed = {p: until for p, until in self._departed.items() if until > now}
        self._departed[peer_id] = now + DEPARTED_GRACE
        self._timeouts.pop(peer_id, None)
        self.routing_table.remove(node_id_of(peer_id))  # from its bucket or the replacement cache
        logger.debug("DHT node %s left", peer_id)

    def _has_departed(self, peer_id: str) -> bool:
        until = self._departed.get(peer_id)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._departed[peer_id]
        return False
