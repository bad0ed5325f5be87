"""What a node's stores, gets and hand-offs need of the node that runs them (`NodeContext`).

`replication`, `store_operation`, `retrieval` and `handoff` run on a `DHTNode` (`node.py`) but
import nothing from it: they take this small interface, so the node imports them and not the
other way round.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from swarm.dht.config import DHTConfig
from swarm.dht.ids import DHTID
from swarm.dht.protocol import DHTProtocol
from swarm.dht.routing import RoutingTable
from swarm.dht.storage import CacheStorage, DHTLocalStorage
from swarm.dht.traversal import AskFn, LookupResult, Traversal
from swarm.dht.validation import DHTRecord, RecordValidator

T = TypeVar("T")


@dataclass
class LookupStats:
    """Counters of the lookups this node ran (for the simulation and for monitoring).

    `hops` counts lookups by their number of sequential request steps; for a get that found a
    value, the steps until the first node that returned it.
    """

    lookups: int = 0
    found: int = 0
    timed_out: int = 0
    requests: int = 0
    hops: Counter[int] = field(default_factory=Counter)

    def record(self, hops: int, requests: int, found: bool = False, timed_out: bool = False) -> None:
        self.lookups += 1
        self.found += found
        self.timed_out += timed_out
        self.requests += requests
        self.hops[hops] += 1


class NodeContext(Protocol):
    """The parts of a `DHTNode` its stores, gets and hand-offs use."""

    @property
    def peer_id(self) -> str: ...
    @property
    def node_id(self) -> DHTID: ...
    @property
    def client_mode(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def config(self) -> DHTConfig: ...
    @property
    def protocol(self) -> DHTProtocol: ...
    @property
    def routing_table(self) -> RoutingTable: ...
    @property
    def storage(self) -> DHTLocalStorage: ...
    @property
    def cache(self) -> CacheStorage | None: ...
    @property
    def validator(self) -> RecordValidator: ...
    @property
    def stats(self) -> LookupStats: ...
    @property
    def published(self) -> dict[tuple[bytes, bytes], DHTRecord]:
        """Records this node wrote, republished until they expire."""
        ...

    def spawn(self, coro: Coroutine[object, None, T], name: str) -> asyncio.Task[T]:
        """Runs `coro` as a task the node owns (cancelled at shutdown, failures logged)."""
        ...

    def lookup(
        self, query_ids: Sequence[DHTID], ask: AskFn, beam_size: int,
        on_finished: Callable[[list[tuple[DHTID, LookupResult]]], None] | None, alpha: int | None = None,
        hedge_after: float | None = None,
    ) -> Traversal:
        """An iterative lookup of `query_ids` starting from this node's nearest neighbours."""
        ...
