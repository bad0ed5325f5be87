"""One store of records on the nodes nearest to their keys (Kademlia §2.3 STORE), from the first
request to the last replica: `StoreOperation`, run by `Replicator.store_many` (`replication.py`).

1. First round (`launch`): each key's records go to the nodes the routing table knows nearest to
   it, in Stores that also ask for the nodes they know nearest to the key: first to the nearest
   one, then, once it answered (or a few round trips later), to the others.
2. Lookup, only if needed: when every first-round node answered and none named a node that
   should hold the key and was not sent it, §2.3's lookup would end right there, and the store
   takes one round trip. Otherwise the iterative lookup (`traversal.py`) runs, its first round
   being the requests already sent (`ask`), and the nearest nodes it finds get the records too.
3. Outcomes: a record's outcome is settled once the nearest other node known accepted it, or
   once every node it was sent to answered (or at the deadline); the operation goes on until
   every request has ended.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, cast

from swarm.core.multiaddr import is_relayed
from swarm.core.timeutil import get_dht_time
from swarm.dht.batching import chunks
from swarm.dht.buckets import NodeInfo
from swarm.dht.context import NodeContext
from swarm.dht.ids import DHTID
from swarm.dht.store_outcome import OutcomeLedger, StoreOutcome
from swarm.dht.traversal import LookupResult
from swarm.dht.validation import DHTRecord
from swarm.dht.wire import OUTDATED, STORED, FindAnswer, StoreResult, store_item
from swarm.proto import dht_pb2

T = TypeVar("T")


async def _maybe(call: Awaitable[T] | None) -> T | None:
    return None if call is None else await call


class StoreOperation:
    """One run of `Replicator.store_many` (see the module docstring).

    Args:
        node: The node that stores.
        store_locally: Keeps a replica on this node and counts it in the record's outcome.
        records: The records, each with its original key.
        on_result: Called with (index, outcome) as each record's outcome is settled.
    """

    def __init__(
        self,
        node: NodeContext,
        store_locally: Callable[[DHTRecord, StoreOutcome], None],
        records: Sequence[DHTRecord],
        on_result: Callable[[int, StoreOutcome], None] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.node = node
        self.store_locally = store_locally
        self.node_id = node.node_id
        self.protocol = node.protocol
        self.config = node.config
        self.replicas = self.config.num_replicas
        self.records = records
        self.ledger = OutcomeLedger(len(records), on_result)
        """Each record's outcome, and which are settled (`store_outcome.py`)."""
        self.settled = self.ledger.settled
        """Done once every record's outcome is settled (or with the error that ended the store)."""
        self.items: dict[int, dht_pb2.DHTStoreItem] = {}
        self.key_ids = [DHTID.from_bytes(record.key) for record in records]
        self.by_key: dict[DHTID, list[int]] = {}
        now = get_dht_time()
        for index, record in enumerate(records):
            if record.expiration_time <= now:
                self.ledger.settle(index)
            else:
                self.by_key.setdefault(self.key_ids[index], []).append(index)
        self.sent: dict[DHTID, set[DHTID]] = {key_id: set() for key_id in self.by_key}
        """Nodes each key was sent to; this node's own ID marks a replica kept here."""
        self.closest: dict[DHTID, float] = {}
        """Distance to each key of the nearest other node known so far."""
        self.sends: set[asyncio.Task[list[StoreResult] | None]] = set()
        """Store requests in flight."""
        # the first round (`launch`)
        self.first_round: dict[DHTID, dict[DHTID, asyncio.Task[list[StoreResult] | None]]] = {}
        """For each node sent records before any lookup, the request that carries each key."""
        self.carried: dict[asyncio.Task[list[StoreResult] | None], list[int]] = {}
        """The records each first-round request carries."""
        self.first_targets: dict[DHTID, dict[DHTID, NodeInfo]] = {}
        self.worst: dict[DHTID, float] = {}
        """Distance to each key of its farthest first-round target (infinite while there are too few)."""
        self.first_left = 0
        self.nearest_left = 0  # requests of the first wave not answered yet
        self.second_wave: list[tuple[NodeInfo, list[int]]] | None = None
        """First-round requests to send once the first wave answered (None once sent)."""
        self.hedge: asyncio.TimerHandle | None = None
        self.verdict: asyncio.Future[bool] = loop.create_future()
        """Whether the first round sufficed: every node answered, and none named a nearer node."""

    # -- outcomes ---------------------------------------------------------------------------------

    def results(self) -> list[StoreOutcome]:
        return self.ledger.results()

    def learn(self, key_id: DHTID, nearest: Sequence[NodeInfo]) -> None:
        """Notes the nearest node an answer names (answers list the nearest first), passing over
        suspects (nodes whose last request from this one timed out): a crashed node stays in
        others' routing tables for minutes, and a store settled only by it would wait out its
        request timeout every time. A reader passes over it the same way
        (`traversal.py`), so the nearest node that answers is the one it reads first."""
        is_suspect = self.protocol.contacts.is_suspect
        node = next((n for n in nearest if not is_suspect(n.peer_id)), None)
        if node is None:
            return
        distance = node.node_id ^ key_id
        if distance < self.closest.get(key_id, math.inf):
            self.closest[key_id] = distance

    def account(self, node: NodeInfo, indices: list[int], answers: list[StoreResult] | None, wave: int = 0) -> None:
        """Counts a node's answers to a request (None: it did not answer); `wave`: 1 or 2 for the
        first round's requests (`launch`), 0 for the others."""
        first = wave > 0
        for position, index in enumerate(indices):
            outcome = self.ledger.outcomes[index]
            if answers is None:
                outcome.unanswered += 1
            else:
                answer = answers[position]
                key_id = self.key_ids[index]
                if answer.nearest:
                    self.learn(key_id, answer.nearest)
                    if first and self.unknown_nearer(key_id, answer.nearest):
                        self.decide(False)
                if answer.status == STORED:
                    outcome.stored += 1
                    if node.node_id ^ key_id <= self.closest.get(key_id, math.inf):
                        self.ledger.settle(index)  # the nearest node any reader asks has it
                elif answer.status == OUTDATED:
                    outcome.outdated += 1
                else:
                    outcome.rejected.append(f"{node.peer_id}: {answer.reason}")
            self.ledger.release(index)
        if first:
            if answers is None:
                self.decide(False)  # a lookup finds the next nearest node instead
            self.first_left -= 1
            if self.first_left == 0:
                self.decide(True)
        if wave == 1:
            self.nearest_left -= 1
            if self.nearest_left == 0 or answers is None:
                self.send_second_wave()

    # -- where records go -------------------------------------------------------------------------

    def targets(self, key_id: DHTID, nearest: list[NodeInfo]) -> list[NodeInfo]:
        """The nodes that should hold the key; keeps a replica here if this node is one of them.

        With `DHTConfig.diversity`, at most `per_key` of them from one network prefix: nodes past
        that share are skipped for the next nearest of other networks, taken from `nearest` and
        then from the routing table (which holds few contacts per network, so one host's
        identities ground near the key cannot take every replica)."""
        replicas = self.replicas
        diversity = self.config.diversity
        if diversity is None:
            chosen = nearest[:replicas]
        else:
            prior = self.first_targets.get(key_id, {}).values()
            chosen = diversity.pick(nearest, replicas, prior)
            if len(chosen) < min(replicas, len(nearest)):
                known = self.node.routing_table.get_nearest_neighbors(key_id, self.config.bucket_size)
                seen = {node.node_id for node in nearest}
                pool = sorted([*nearest, *(n for n in known if n.node_id not in seen)],
                              key=lambda node: node.node_id ^ key_id)
                chosen = diversity.pick(pool, replicas, prior)
        node_id = self.node_id
        if not self.node.client_mode and (len(chosen) < replicas or node_id ^ key_id < chosen[-1].node_id ^ key_id):
            chosen = chosen[: replicas - 1]
            if node_id not in self.sent[key_id]:
                self.sent[key_id].add(node_id)
                for index in self.by_key[key_id]:
                    self.store_locally(self.records[index], self.ledger.outcomes[index])
        if chosen and all(is_relayed(n.addr) for n in chosen):
            # relayed nodes are never a record's only replicas while a direct one is known (docs/relay.md)
            direct = next((n for n in self.node.routing_table.get_nearest_neighbors(key_id, self.config.bucket_size)
                           if not is_relayed(n.addr)), None)
            if direct is not None:
                chosen = [*chosen, direct]
        return chosen

    def item(self, index: int) -> dht_pb2.DHTStoreItem:
        """The wire form of a record, built once and sent to every replica."""
        built = self.items.get(index)
        if built is None:
            built = self.items[index] = store_item(self.records[index])
        return built

    async def send(self, node: NodeInfo, indices: list[int], count: int, wave: int) -> list[StoreResult] | None:
        answers = None
        try:
            answers = await self.protocol.call_store(node, [self.item(i) for i in indices], count)
            return answers
        finally:
            self.account(node, indices, answers, wave)

    def start(
        self, node: NodeInfo, indices: list[int], count: int = 0, wave: int = 0
    ) -> asyncio.Task[list[StoreResult] | None]:
        """Sends records to a node, in a task of the node's own (it completes even if the lookup
        ends first, and is cancelled if the node shuts down)."""
        for index in indices:
            self.ledger.pending[index] += 1
            self.sent[self.key_ids[index]].add(node.node_id)
        task = self.node.spawn(self.send(node, indices, count, wave), f"dht-store-{node.peer_id[-8:]}")
        self.sends.add(task)
        task.add_done_callback(self.sends.discard)
        return task

    def cancel(self) -> None:
        """Stops every request (and sends no more)."""
        self.second_wave = None
        if self.hedge is not None:
            self.hedge.cancel()
        for task in list(self.sends):
            task.cancel()

    # -- the first round --------------------------------------------------------------------------

    def launch(self) -> None:
        """Sends each key's records to the nodes the routing table knows nearest to it.

        In a settled network they are the nodes that should hold them. These requests also ask
        for their nearest nodes: they are the first round of the key's lookup (§2.3), and when
        they name no nearer node, the lookup is over.

        They go in two waves: first to the nodes that are the nearest to some key, then, once
        those answered (or after a few round trips, or as soon as one failed), to the others. On
        a few cores, requests that arrive together are served together, each slowly: the first
        wave has them to itself, so the answer that settles a store comes back in one round trip.
        """
        rounds: dict[DHTID, tuple[int, NodeInfo, list[int]]] = {}
        for key_id, indices in self.by_key.items():
            for index in indices:
                self.ledger.pending[index] = 1  # the lookup's share, released when the key's lookup ends
            nearest = self.node.routing_table.get_nearest_neighbors(key_id, self.replicas)
            if nearest:
                self.learn(key_id, nearest)
            chosen = self.targets(key_id, nearest)
            self.first_targets[key_id] = {node.node_id: node for node in chosen}
            enough = len(chosen) + (self.node_id in self.sent[key_id]) >= self.replicas
            self.worst[key_id] = max((node.node_id ^ key_id for node in chosen), default=math.inf) if enough else math.inf
            for rank, node in enumerate(chosen):
                entry = rounds.get(node.node_id)
                if entry is None:
                    rounds[node.node_id] = (rank, node, list(indices))
                else:
                    rounds[node.node_id] = (min(rank, entry[0]), node, [*entry[2], *indices])
        first_wave: list[tuple[NodeInfo, list[int]]] = []
        second_wave: list[tuple[NodeInfo, list[int]]] = []
        for rank, node, indices in sorted(rounds.values(), key=lambda entry: entry[0]):  # the nearest first
            self.first_round[node.node_id] = {}
            sizes = [len(self.records[index].value) for index in indices]
            for chunk in chunks(indices, sizes, self.config.max_keys_per_call):
                self.first_left += 1
                for index in chunk:
                    self.sent[self.key_ids[index]].add(node.node_id)
                (first_wave if rank == 0 else second_wave).append((node, chunk))
        self.nearest_left = len(first_wave)
        self.second_wave = second_wave
        for node, chunk in first_wave:
            self.carry(node, chunk, wave=1)
        if second_wave:
            hedge = min(3 * self.protocol.round_trip, self.config.request_timeout / 2)
            self.hedge = asyncio.get_running_loop().call_later(hedge, self.send_second_wave)

    def send_second_wave(self) -> None:
        waiting, self.second_wave = self.second_wave, None
        if self.hedge is not None:
            self.hedge.cancel()
        for node, chunk in waiting or ():
            self.carry(node, chunk, wave=2)

    def carry(self, node: NodeInfo, indices: list[int], wave: int) -> None:
        """Sends a first-round request; it asks for as many nearest nodes as the lookup's beam."""
        task = self.start(node, indices, self.replicas, wave)
        self.carried[task] = indices
        requests = self.first_round[node.node_id]
        for index in indices:
            requests[self.key_ids[index]] = task

    def unknown_nearer(self, key_id: DHTID, nearest: Sequence[NodeInfo]) -> bool:
        """Whether a first-round answer names a node that should hold the key and was not sent it:
        nearer than a first-round target, or any other node while there are too few of them."""
        worst, targets = self.worst[key_id], self.first_targets[key_id]
        for node in nearest:  # nearest first
            if node.node_id ^ key_id >= worst:
                return False
            if node.node_id not in targets and node.node_id != self.node_id:
                return True
        return False

    def decide(self, suffices: bool) -> None:
        if not self.verdict.done():
            self.verdict.set_result(suffices)
            if not suffices:
                self.send_second_wave()  # a lookup starts: it asks every node at once anyway

    # -- the lookup -------------------------------------------------------------------------------

    async def ask(self, node: NodeInfo, keys: list[DHTID]) -> dict[DHTID, list[NodeInfo]] | None:
        """A lookup step: the answer to the first-round store for keys it carried to this node, a
        Find for the others."""
        requests = self.first_round.get(node.node_id, {})
        stores = list({requests[key_id] for key_id in keys if key_id in requests})
        find_keys = [key_id for key_id in keys if key_id not in requests]
        finds = self.protocol.call_find(node, find_keys, nodes_only=True, count=self.replicas) if find_keys else None
        # shielded: a store belongs to the whole operation, and completes even if the lookup ends first
        stored_and_found = await asyncio.gather(*(asyncio.shield(task) for task in stores), _maybe(finds))
        stored = cast(list[list[StoreResult] | None], stored_and_found[:-1])
        found = cast(dict[DHTID, FindAnswer] | None, stored_and_found[-1])
        if any(answers is None for answers in stored) or (find_keys and found is None):
            return None
        answer: dict[DHTID, list[NodeInfo]] = {}
        for task, answers in zip(stores, stored):
            for index, result in zip(self.carried[task], answers or []):
                answer.setdefault(self.key_ids[index], result.nearest)
        if found is not None:
            for key_id, found_answer in found.items():
                if found_answer.nearest:
                    self.learn(key_id, found_answer.nearest)
                answer[key_id] = found_answer.nearest
        return answer

    def finished(self, results: list[tuple[DHTID, LookupResult]]) -> None:
        """Keys whose lookup ended: their records go to the nearest nodes not sent them yet."""
        batches: dict[DHTID, tuple[NodeInfo, list[int]]] = {}
        for key_id, result in results:
            self.node.stats.record(result.hops, result.requests, timed_out=result.timed_out)
            for target in self.targets(key_id, result.nearest):
                if target.node_id in self.sent[key_id]:
                    continue
                batch = batches.get(target.node_id)
                if batch is None:
                    batch = batches[target.node_id] = (target, [])
                batch[1].extend(self.by_key[key_id])
        for target, indices in batches.values():
            sizes = [len(self.records[index].value) for index in indices]
            for chunk in chunks(indices, sizes, self.config.max_keys_per_call):
                self.start(target, chunk)
        for key_id, _ in results:
            for index in self.by_key[key_id]:
                self.ledger.release(index)

    async def run(self, deadline: float) -> None:
        """Looks the keys up if the first round did not find their nearest nodes, and stores their
        records where the lookup ends; ends when every store has ended (or at the deadline)."""
        loop = asyncio.get_running_loop()
        try:
            if self.first_left:
                await asyncio.wait([self.verdict], timeout=max(0.0, deadline - loop.time()))
            if self.verdict.done() and self.verdict.result():
                # §2.3: the lookup is over when the nearest nodes known all answered and none of
                # them knows a nearer one
                self.finished([
                    (key_id, LookupResult(sorted(targets.values(), key=lambda n: n.node_id ^ key_id), 1, len(targets)))
                    for key_id, targets in self.first_targets.items()
                ])
            else:
                traversal = self.node.lookup(  # it asks the first-round nodes again for nothing (`ask`)
                    list(self.by_key), self.ask, self.replicas, self.finished,
                    alpha=max(self.config.alpha, self.replicas),
                )
                await traversal.run(max(0.0, deadline - loop.time()))
            while self.sends and loop.time() < deadline:
                await asyncio.wait(list(self.sends), timeout=max(0.0, deadline - loop.time()))
        except Exception as e:
            if self.settled.done():
                raise  # every caller has its answer: the failure is logged (`DHTNode.spawn`)
            self.ledger.fail(e)  # the caller sees the error instead of outcomes
        finally:
            self.cancel()
            if self.sends:
                await asyncio.gather(*self.sends, return_exceptions=True)
            for index in range(len(self.records)):
                self.ledger.settle(index)  # the deadline passed, or the node is shutting down
