"""Kademlia's iterative parallel lookup (§2.3), for many keys at once, sharing requests.

For each key, the lookup keeps its candidates ordered by XOR distance and asks the nearest ones
it has not asked yet, at most `alpha` at a time per key; every answer brings nodes nearer to the
key. A key's lookup ends when the `beam_size` nearest nodes it knows of have all answered (nodes
that failed to answer drop out), when the caller calls `finish` (a value was found), or at the
deadline. This is §2.3's node lookup with k = `beam_size`; a lookup with dead nodes among its
candidates goes on without them, and every request has its own timeout (the `ask` callable's).

A node that does not answer within `slow_after` seconds gives up its place among the `alpha`
requests in flight (§2.3: "nodes that fail to respond quickly are removed from consideration"),
so the lookup asks the next candidates instead of idling behind a lost request. A lookup still
waits for a slow node that may belong to its result, though (until that request fails or the
deadline): ending without it would store records on, or look them up from, the wrong nodes
whenever the network is merely congested. A suspect (`is_suspect`: a node whose last request from
this peer timed out, and that has not answered since) is asked too, and its answer counts if it
comes in time, but once any node answered the key, the lookup no longer waits for it: a crashed
node stays in other nodes' routing tables for minutes, and every lookup near it would otherwise
wait out a whole request timeout again (before it did, every read of a declaration key waited 3 s for
the same crashed replica, round after round, until a leader started without the readers). Its
request is not cancelled when the lookup ends but handed to `adopt` (the node's background
tasks), so that its timeout still counts against it and a dead node leaves the routing table
after a few (`contacts.TIMEOUTS_TO_DROP`) instead of staying named in every answer.

With `hedge_after`, each key starts with a single request, to its nearest candidate, and widens
to `alpha` (on every path) once that request is answered or `hedge_after` seconds have passed (a hedged request,
Dean & Barroso, "The Tail at Scale", CACM 2013): a get whose nearest node holds the value costs
one request instead of alpha, while a slow or dead node delays it by `hedge_after` at most.

Many keys are looked up together: the keys that want to ask the same node in the same round
share one request, and a request to a node also carries the other keys that have room for a
request and for which that node is a useful candidate (so one Find answers for many keys).

With `disjoint_paths` = d > 1, each key is looked up along d paths that never share a node
(S/Kademlia, Baumgart & Mies, ICPADS 2007, §4.4): the starting candidates are dealt out among the
paths, nearest first, and a node that one path has asked is never asked by the others.
Each path runs the lookup above with its own `alpha` and `beam_size`; the key's result is the
`beam_size` nearest nodes that answered on any path. A set of lying nodes that answers only with
one another captures the paths that meet it first, but not the paths that started elsewhere, so
it cannot hide a key from a reader that knows one honest node off its paths. The price is up to d
times the requests of one path (measured in BENCHMARKS.md, `scripts/bench/bench_dht.py`).

The algorithm is pure: it talks to the network only through `ask`, so tests drive it with an
in-memory network (tests/dht/test_traversal.py) and the simulation with the real protocol.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarm.dht.buckets import NodeInfo
from swarm.dht.ids import DHTID

logger = logging.getLogger(__name__)

AskFn = Callable[[NodeInfo, list[DHTID]], Awaitable[Mapping[DHTID, Sequence[NodeInfo]] | None]]
"""`ask(node, keys)`: the nodes `node` knows nearest to each key, or None if it did not answer."""

_UNQUERIED, _IN_FLIGHT, _RESPONDED, _FAILED, _TAKEN = range(5)  # _TAKEN: asked by another path

_Ref = tuple[DHTID, int]
"""One path of one key's lookup: (key, path)."""


@dataclass
class LookupResult:
    """How the lookup of one key ended.

    Attributes:
        nearest: The nearest nodes that answered (at most `beam_size`), nearest first.
        hops: The longest chain of referrals that led to a node in `nearest` (1: the node was
            a starting candidate), i.e. the number of sequential steps the lookup took.
        requests: Nodes asked about this key.
        finished_early: `Traversal.finish` ended it (for example, a value was found).
        timed_out: The deadline ended it.
    """

    nearest: list[NodeInfo]
    hops: int
    requests: int
    finished_early: bool = False
    timed_out: bool = False


class _Query:
    __slots__ = ("beam", "done", "early", "heap", "id", "in_flight", "path", "ref", "requests", "slow", "status",
                 "suspect", "wide", "worth")

    def __init__(self, query_id: DHTID, path: int) -> None:
        self.id = query_id  # the key: distances are measured to it
        self.path = path
        self.ref: _Ref = (query_id, path)  # one path of one key
        self.status: dict[DHTID, int] = {}
        self.heap: list[tuple[int, DHTID]] = []  # (distance, node): candidates, lazily cleaned
        self.beam: list[tuple[int, DHTID]] = []  # (-distance, node): the nearest that answered
        self.in_flight: set[DHTID] = set()  # asked, not answered, not yet slow
        self.slow: set[DHTID] = set()  # asked, slow to answer: no longer holds an alpha slot (§2.3)
        self.suspect: set[DHTID] = set()  # asked, timed out last time: not waited for once one answered
        self.requests = 0
        self.done = False
        self.early = False
        self.wide = True  # False while a hedged lookup waits on its first request
        self.worth: float | None = None  # cached Traversal._worth_asking; None when stale

    def limit(self, alpha: int) -> int:
        """Requests this path may have in flight now (a hedged lookup starts on its first path)."""
        if self.wide:
            return alpha
        return 1 if self.path == 0 else 0


class Traversal:
    """One lookup of many keys (see the module docstring).

    Args:
        initial: For each key to look up, the nodes to start from (the local routing table's
            nearest).
        ask: How to ask a node about keys.
        beam_size: How many nearest nodes must answer for a key's lookup to end (k in §2.3).
        alpha: Requests in flight at once per key (§2.3's alpha).
        max_keys_per_call: Most keys in one request.
        exclude: Node IDs never to ask (this node).
        is_banned: PeerIDs to skip (blacklisted after failing).
        is_suspect: PeerIDs whose last request timed out: asked, but not waited for once another
            node answered the key (see the module docstring).
        adopt: Takes over a suspect's request still running when the lookup ends (None: it is
            cancelled like the others).
        on_finished: Called with the keys whose lookup ended, as they end, so that the caller
            can act on each key without waiting for the slowest.
        hedge_after: Start each key with one request and widen to `alpha` after its first
            answer or this many seconds (None: `alpha` requests from the start).
        slow_after: Seconds after which an unanswered request frees its place among the `alpha`
            in flight (None: requests hold it until they end).
        disjoint_paths: Paths, sharing no node, along which each key is looked up (1: plain
            Kademlia).
    """

    def __init__(
        self,
        initial: Mapping[DHTID, Iterable[NodeInfo]],
        ask: AskFn,
        *,
        beam_size: int,
        alpha: int,
        max_keys_per_call: int = 128,
        exclude: Collection[DHTID] = (),
        is_banned: Callable[[str], bool] | None = None,
        is_suspect: Callable[[str], bool] | None = None,
        adopt: Callable[[asyncio.Task[object]], None] | None = None,
        on_finished: Callable[[list[tuple[DHTID, LookupResult]]], None] | None = None,
        hedge_after: float | None = None,
        slow_after: float | None = None,
        disjoint_paths: int = 1,
    ) -> None:
        if beam_size < 1 or alpha < 1 or max_keys_per_call < 1 or disjoint_paths < 1:
            raise ValueError("beam_size, alpha, max_keys_per_call and disjoint_paths must be >= 1")
        self.beam_size = beam_size
        self.alpha = alpha
        self.max_keys_per_call = max_keys_per_call
        self._ask = ask
        self._exclude = set(exclude)
        self._is_banned = is_banned
        self._is_suspect = is_suspect
        self._adopt = adopt
        self._on_finished = on_finished
        self._hedge_after = hedge_after
        self._slow_after = slow_after
        self._slow_at: dict[asyncio.Task[Mapping[DHTID, Sequence[NodeInfo]] | None], float] = {}
        self.nodes: dict[DHTID, NodeInfo] = {}
        self._hops: dict[DHTID, int] = {}
        self._failed: set[DHTID] = set()
        self._waiting: dict[DHTID, set[_Ref]] = {}  # node -> key paths for which it is an unasked candidate
        self._queries: dict[_Ref, _Query] = {}
        self._active: dict[_Ref, _Query] = {}
        self._paths: dict[DHTID, list[_Query]] = {}
        self._claims: dict[DHTID, dict[DHTID, int]] = {}  # key -> node -> the path that took it
        self._ended: list[DHTID] = []
        self._tasks: dict[asyncio.Task[Mapping[DHTID, Sequence[NodeInfo]] | None], tuple[DHTID, list[_Ref]]] = {}
        self.results: dict[DHTID, LookupResult] = {}
        for query_id, nodes in initial.items():
            key = DHTID(query_id)
            paths = self._paths[key] = [_Query(key, path) for path in range(disjoint_paths)]
            if disjoint_paths > 1:
                self._claims[key] = {}
            for query in paths:
                self._queries[query.ref] = self._active[query.ref] = query
                query.wide = hedge_after is None
            starts = sorted(nodes, key=lambda node: node.node_id ^ key)
            for position, node in enumerate(starts):  # dealt out nearest first
                self._add_candidate(paths[position % disjoint_paths], node, 1)

    # -- state ----------------------------------------------------------------------------------

    def hops_of(self, node_id: DHTID) -> int:
        """The referral steps that led to `node_id` (1: a starting candidate)."""
        return self._hops.get(node_id, 0)

    def finish(self, query_id: DHTID) -> None:
        """Ends the lookup of `query_id` now, on every path (its answers so far are its result)."""
        for query in self._paths.get(query_id, ()):
            if not query.done:
                query.early = True
                self._end(query)

    def _end(self, query: _Query, timed_out: bool = False) -> None:
        if query.done:
            return
        query.done = True
        del self._active[query.ref]
        for node_id, status in query.status.items():
            if status == _UNQUERIED:
                waiting = self._waiting.get(node_id)
                if waiting is not None:
                    waiting.discard(query.ref)
        paths = self._paths[query.id]
        if not all(path.done for path in paths):
            return
        answered = heapq.nsmallest(
            self.beam_size, {node_id: -negative for path in paths for negative, node_id in path.beam}.items(),
            key=lambda item: item[1])
        self.results[query.id] = LookupResult(
            nearest=[self.nodes[node_id] for node_id, _ in answered],
            hops=max((self._hops.get(node_id, 1) for node_id, _ in answered), default=0),
            requests=sum(path.requests for path in paths),
            finished_early=any(path.early for path in paths),
            timed_out=timed_out,
        )
        self._ended.append(query.id)

    def _worst(self, query: _Query) -> float:
        """Distance of the farthest node in a full beam; infinity while the beam is not full."""
        return -query.beam[0][0] if len(query.beam) >= self.beam_size else math.inf

    def _worth_asking(self, query: _Query) -> float:
        """Candidates nearer than this are worth asking now: fewer than `beam_size` nodes nearer
        than them have answered or are being asked. Counting requests in flight as if they will
        succeed keeps a wide first round (alpha >= beam_size) from asking nodes that cannot make
        the beam; if one of them fails, the next candidate becomes worth asking."""
        if query.worth is not None:
            return query.worth
        if len(query.beam) + len(query.in_flight) - len(query.suspect & query.in_flight) < self.beam_size:
            query.worth = math.inf
        else:
            distances = [-negative for negative, _ in query.beam]
            distances.extend(node_id ^ query.id for node_id in query.in_flight if node_id not in query.suspect)
            query.worth = heapq.nsmallest(self.beam_size, distances)[-1]
        return query.worth

    def _add_candidate(self, query: _Query, node: NodeInfo, hops: int) -> None:
        node_id = node.node_id
        if node_id in query.status or node_id in self._exclude or node_id in self._failed:
            return
        if self._taken(query, node_id):
            return
        if node_id not in self.nodes:
            self.nodes[node_id] = node
            self._hops[node_id] = hops
        query.status[node_id] = _UNQUERIED
        heapq.heappush(query.heap, (node_id ^ query.id, node_id))
        waiting = self._waiting.get(node_id)
        if waiting is None:
            waiting = self._waiting[node_id] = set()
        waiting.add(query.ref)

    def _taken(self, query: _Query, node_id: DHTID) -> bool:
        """Whether another path of the key asked `node_id` (disjoint paths: a node serves one path)."""
        claims = self._claims.get(query.id)
        return claims is not None and claims.get(node_id, query.path) != query.path

    def _peek(self, query: _Query, limit: float) -> tuple[int, DHTID] | None:
        """The nearest unasked candidate nearer than `limit` (cleaning the heap on the way), or None."""
        heap = query.heap
        while heap:
            distance, node_id = heap[0]
            status = query.status[node_id]
            if status == _UNQUERIED and node_id in self._failed:
                query.status[node_id] = status = _FAILED
            if status == _UNQUERIED and self._is_banned is not None and self._is_banned(self.nodes[node_id].peer_id):
                self._failed.add(node_id)
                query.status[node_id] = status = _FAILED
            if status == _UNQUERIED and self._taken(query, node_id):
                query.status[node_id] = status = _TAKEN
            if status != _UNQUERIED:
                heapq.heappop(heap)
                continue
            return (distance, node_id) if distance < limit else None
        return None

    def _is_done(self, query: _Query) -> bool:
        worst = self._worst(query)
        waived = query.suspect if query.beam else ()  # with no answer yet, a suspect is all there is
        if any(node_id ^ query.id < worst and node_id not in waived for node_id in query.in_flight):
            return False
        if any(node_id ^ query.id < worst and node_id not in waived for node_id in query.slow):
            return False
        return self._peek(query, worst) is None

    def _send(self, node_id: DHTID, query: _Query, batch: list[_Ref]) -> None:
        query.status[node_id] = _IN_FLIGHT
        claims = self._claims.get(query.id)
        if claims is not None:
            claims[node_id] = query.path
        query.in_flight.add(node_id)
        if self._is_suspect is not None and self._is_suspect(self.nodes[node_id].peer_id):
            query.suspect.add(node_id)
        query.worth = None
        query.requests += 1
        waiting = self._waiting.get(node_id)
        if waiting is not None:
            waiting.discard(query.ref)
        batch.append(query.ref)

    def _schedule(self) -> None:
        wanted: dict[DHTID, list[_Ref]] = {}
        query: _Query | None
        for query in list(self._active.values()):
            while len(query.in_flight) < query.limit(self.alpha):
                candidate = self._peek(query, self._worth_asking(query))
                if candidate is None:
                    break
                heapq.heappop(query.heap)
                node_id = candidate[1]
                batch = wanted.get(node_id)
                if batch is None:
                    batch = wanted[node_id] = []
                self._send(node_id, query, batch)
        for node_id, batch in wanted.items():
            # piggyback: other keys with room for a request, for which this node is a useful,
            # unasked candidate (if not their very nearest), ride along in the same request
            for ref in list(self._waiting.get(node_id, ())):
                query = self._active.get(ref)
                if (
                    query is not None
                    and len(query.in_flight) < query.limit(self.alpha)
                    and node_id ^ query.id < self._worth_asking(query)
                    and not self._taken(query, node_id)
                ):
                    self._send(node_id, query, batch)
            node = self.nodes[node_id]
            for start in range(0, len(batch), self.max_keys_per_call):
                refs = batch[start : start + self.max_keys_per_call]  # one path per key: a node is on one
                task = asyncio.ensure_future(self._ask(node, [query_id for query_id, _ in refs]))
                self._tasks[task] = (node_id, refs)
                if self._slow_after is not None:
                    self._slow_at[task] = asyncio.get_running_loop().time() + self._slow_after

    def _absorb(
        self, node_id: DHTID, refs: list[_Ref], answer: Mapping[DHTID, Sequence[NodeInfo]] | None
    ) -> None:
        if answer is None:
            self._failed.add(node_id)
            self._waiting.pop(node_id, None)
        hops = self._hops.get(node_id, 1) + 1
        for ref in refs:
            query = self._queries[ref]
            query_id = query.id
            query.in_flight.discard(node_id)
            query.slow.discard(node_id)
            query.suspect.discard(node_id)
            if not query.wide:  # a hedged lookup widens on its first answer, on every path
                for path in self._paths[query_id]:
                    path.wide = True
            query.worth = None
            if answer is None:
                query.status[node_id] = _FAILED
                continue
            query.status[node_id] = _RESPONDED
            if query.done:
                continue
            distance = node_id ^ query_id
            if len(query.beam) < self.beam_size:
                heapq.heappush(query.beam, (-distance, node_id))
            elif distance < -query.beam[0][0]:
                heapq.heapreplace(query.beam, (-distance, node_id))
            for neighbor in answer.get(query_id, ()):
                self._add_candidate(query, neighbor, hops)

    def _mark_slow(self, now: float) -> set[_Ref]:
        """Takes requests older than `slow_after` out of consideration; returns the key paths affected."""
        touched: set[_Ref] = set()
        for task, when in list(self._slow_at.items()):
            if when > now:
                continue
            del self._slow_at[task]
            node_id, refs = self._tasks[task]
            for ref in refs:
                query = self._queries[ref]
                if node_id in query.in_flight:
                    query.in_flight.discard(node_id)
                    query.worth = None
                    query.slow.add(node_id)
                    for path in self._paths[query.id]:
                        path.wide = True
                    touched.add(ref)
        return touched

    def _report(self) -> None:
        if not self._ended:
            return
        ended, self._ended = self._ended, []
        if self._on_finished is not None:
            self._on_finished([(query_id, self.results[query_id]) for query_id in ended])

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, timeout: float | None = None) -> dict[DHTID, LookupResult]:
        """Runs every key's lookup to its end; returns each key's result.

        Cancelling `run` cancels its requests.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        hedge = None if self._hedge_after is None else loop.time() + self._hedge_after
        query: _Query | None
        try:
            for query in list(self._active.values()):
                if self._is_done(query):
                    self._end(query)
            self._schedule()
            self._report()
            while self._tasks and self._active:  # requests left when every key ended are cancelled
                now = loop.time()
                remaining = math.inf if deadline is None else deadline - now
                if remaining <= 0:
                    break
                wake = min(remaining, math.inf if hedge is None else hedge - now,
                           min(self._slow_at.values(), default=math.inf) - now)
                done, _ = await asyncio.wait(
                    self._tasks, timeout=None if wake == math.inf else max(0.0, wake),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                now = loop.time()
                if hedge is not None and now >= hedge:
                    hedge = None  # the hedge fires: every key that still waits widens to alpha
                    for query in self._active.values():
                        query.wide = True
                touched = self._mark_slow(now) if self._slow_at else set()
                for task in done:
                    self._slow_at.pop(task, None)
                    node_id, refs = self._tasks.pop(task)
                    try:
                        answer = task.result()
                    except Exception:
                        logger.exception("DHT lookup request to %s failed", self.nodes[node_id].peer_id)
                        answer = None
                    self._absorb(node_id, refs, answer)
                    touched.update(refs)
                for ref in touched:
                    query = self._active.get(ref)
                    if query is not None and self._is_done(query):
                        self._end(query)
                self._schedule()
                self._report()
            for query in list(self._active.values()):
                self._end(query, timed_out=bool(self._tasks))
            self._report()
            return self.results
        finally:
            tasks = []
            for task, (node_id, _) in self._tasks.items():
                if (self._adopt is not None and self._is_suspect is not None and not task.done()
                        and self._is_suspect(self.nodes[node_id].peer_id)):
                    self._adopt(task)  # its timeout still counts against it (module docstring)
                else:
                    tasks.append(task)
            self._tasks.clear()
            self._slow_at.clear()
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
