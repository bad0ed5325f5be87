"""Tests for swarm.dht.traversal on an in-memory network (no sockets): the iterative lookup finds
the true nearest nodes in few hops, shares requests between keys, and survives dead and hung nodes."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping, Sequence

import pytest

from swarm.core.identity import Identity
from swarm.dht.buckets import NodeInfo
from swarm.dht.ids import DHTID
from swarm.dht.routing import RoutingTable
from swarm.dht.traversal import Traversal


class Network:
    """N nodes, each knowing its k nearest nodes (as in a settled Kademlia network) and a random
    sample of the others, kept in a real routing table (k-buckets)."""

    def __init__(self, size: int, seed: int = 0, contacts: int = 60, bucket_size: int = 20) -> None:
        rng = random.Random(seed)
        self.nodes = [
            NodeInfo(DHTID.generate(rng=rng), f"peer{i}", f"/ip4/10.0.0.{i % 250}/tcp/{1000 + i}") for i in range(size)
        ]
        self.tables: dict[DHTID, RoutingTable] = {}
        for node in self.nodes:
            table = RoutingTable(node.node_id, bucket_size)
            neighbours = sorted(self.nodes, key=lambda other: other.node_id ^ node.node_id)[: bucket_size + 1]
            for other in rng.sample(self.nodes, min(contacts, size)) + neighbours:
                table.add_or_update(other.node_id, other.peer_id, other.addr)
            self.tables[node.node_id] = table
        self.dead: set[DHTID] = set()
        self.hung: set[DHTID] = set()
        self.calls: list[tuple[DHTID, list[DHTID]]] = []
        self.in_flight: dict[DHTID, int] = {}
        self.max_in_flight: dict[DHTID, int] = {}

    def nearest(self, key: int, count: int, alive_only: bool = True) -> list[DHTID]:
        ids = [n.node_id for n in self.nodes if not (alive_only and (n.node_id in self.dead or n.node_id in self.hung))]
        return sorted(ids, key=lambda i: i ^ key)[:count]

    async def ask(self, node: NodeInfo, keys: list[DHTID]) -> Mapping[DHTID, Sequence[NodeInfo]] | None:
        self.calls.append((node.node_id, list(keys)))
        for key in keys:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.max_in_flight[key] = max(self.max_in_flight.get(key, 0), self.in_flight[key])
        try:
            await asyncio.sleep(0)
            if node.node_id in self.hung:
                await asyncio.sleep(3600)
            if node.node_id in self.dead:
                return None
            table = self.tables[node.node_id]
            return {key: table.get_nearest_neighbors(key, 20) for key in keys}
        finally:
            for key in keys:
                self.in_flight[key] -= 1

    def traversal(self, start: NodeInfo, keys: Sequence[DHTID], **kwargs) -> Traversal:
        table = self.tables[start.node_id]
        initial = {key: table.get_nearest_neighbors(key, 20) for key in keys}
        options = {"beam_size": 20, "alpha": 3, "exclude": (start.node_id,)} | kwargs
        return Traversal(initial, self.ask, **options)


def run(coro):
    return asyncio.run(coro)


def test_finds_the_true_nearest_nodes_in_logarithmic_hops() -> None:
    net = Network(400, seed=1)
    rng = random.Random(2)
    keys = [DHTID.generate(rng=rng) for _ in range(30)]
    start = net.nodes[0]
    results = run(net.traversal(start, keys).run(timeout=10))
    for key in keys:
        expected = [i for i in net.nearest(key, 21) if i != start.node_id][:20]
        assert [n.node_id for n in results[key].nearest] == expected
        assert not results[key].timed_out
    worst_hops = max(r.hops for r in results.values())
    assert 1 <= worst_hops <= 2 * math.log2(400), worst_hops


def test_keys_share_requests() -> None:
    net = Network(200, seed=3)
    rng = random.Random(4)
    keys = [DHTID.generate(rng=rng) for _ in range(100)]
    results = run(net.traversal(net.nodes[0], keys, beam_size=5).run(timeout=10))
    asked_per_key = sum(r.requests for r in results.values())
    assert len(net.calls) < asked_per_key / 2, (len(net.calls), asked_per_key)
    assert max(len(keys) for _, keys in net.calls) > 1


def test_alpha_bounds_requests_per_key_even_with_piggybacking() -> None:
    net = Network(300, seed=5)
    key = DHTID.generate(rng=random.Random(6))
    run(net.traversal(net.nodes[0], [key], alpha=2).run(timeout=10))
    assert net.max_in_flight[key] <= 2


def test_max_keys_per_call_splits_requests() -> None:
    net = Network(50, seed=7)
    rng = random.Random(8)
    keys = [DHTID.generate(rng=rng) for _ in range(40)]
    run(net.traversal(net.nodes[0], keys, max_keys_per_call=7).run(timeout=10))
    assert max(len(keys) for _, keys in net.calls) <= 7


def test_dead_nodes_are_skipped_and_never_returned() -> None:
    net = Network(300, seed=9)
    rng = random.Random(10)
    net.dead = {n.node_id for n in rng.sample(net.nodes[1:], 90)}
    keys = [DHTID.generate(rng=rng) for _ in range(10)]
    results = run(net.traversal(net.nodes[0], keys, beam_size=8).run(timeout=10))
    for key in keys:
        found = [n.node_id for n in results[key].nearest]
        assert not set(found) & net.dead
        assert found == [i for i in net.nearest(key, 9) if i != net.nodes[0].node_id][:8]


def test_hung_nodes_cannot_hold_a_lookup_past_its_deadline() -> None:
    net = Network(100, seed=11)
    key = DHTID.generate(rng=random.Random(12))
    net.hung = set(net.nearest(key, 3, alive_only=False))
    start = time.monotonic()
    results = run(net.traversal(net.nodes[-1], [key], beam_size=5).run(timeout=0.3))
    assert time.monotonic() - start < 10.0  # the deadline, not the hung nodes' hour (wide: a loaded CI)
    assert results[key].timed_out
    assert all(n.node_id not in net.hung for n in results[key].nearest)


def test_finish_ends_one_key_and_on_finished_reports_each_key_once() -> None:
    net = Network(200, seed=13)
    rng = random.Random(14)
    keys = [DHTID.generate(rng=rng) for _ in range(5)]
    reported: list[DHTID] = []
    calls_at_finish: list[int] = []
    traversal: Traversal

    async def ask(node, asked):
        answer = await net.ask(node, asked)
        if keys[0] in asked and not calls_at_finish:
            traversal.finish(keys[0])
            calls_at_finish.append(len(net.calls))
        return answer

    table = net.tables[net.nodes[0].node_id]
    traversal = Traversal(
        {key: table.get_nearest_neighbors(key, 20) for key in keys}, ask, beam_size=20, alpha=3,
        on_finished=lambda done: reported.extend(key for key, _ in done),
    )
    results = run(traversal.run(timeout=10))
    assert sorted(reported) == sorted(keys)
    assert results[keys[0]].finished_early
    later = net.calls[calls_at_finish[0]:]
    assert later and not any(keys[0] in asked for _, asked in later)  # never asked about again
    assert not results[keys[1]].finished_early


def test_a_key_with_no_candidates_ends_at_once() -> None:
    results = run(Traversal({DHTID(5): []}, Network(1).ask, beam_size=3, alpha=3).run(timeout=1))
    assert results[DHTID(5)].nearest == [] and results[DHTID(5)].requests == 0


def test_cancelling_run_cancels_its_requests() -> None:
    net = Network(50, seed=15)
    net.hung = {n.node_id for n in net.nodes}

    async def go() -> None:
        traversal = net.traversal(net.nodes[0], [DHTID(1)])
        task = asyncio.ensure_future(traversal.run())
        while not net.calls:  # wait until requests are out
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not traversal._tasks

    run(go())


def test_real_peer_ids_work_as_nodes() -> None:
    identities = [Identity.from_seed(bytes([i]) * 32) for i in range(1, 30)]
    nodes = [NodeInfo(DHTID.from_peer_id(i.peer_id), i.peer_id, "/ip4/127.0.0.1/tcp/1") for i in identities]
    net = Network(1)
    net.nodes = nodes
    net.tables = {}
    for node in nodes:
        table = RoutingTable(node.node_id)
        for other in nodes:
            table.add_or_update(other.node_id, other.peer_id, other.addr)
        net.tables[node.node_id] = table
    key = DHTID.from_key("some key")
    results = run(net.traversal(nodes[0], [key], beam_size=5).run(timeout=5))
    assert [n.node_id for n in results[key].nearest] == [i for i in net.nearest(key, 6) if i != nodes[0].node_id][:5]


def test_a_hedged_lookup_asks_one_node_unless_it_is_slow() -> None:
    net = Network(100, seed=16)
    key = DHTID.generate(rng=random.Random(17))
    start_node = net.nodes[-1]
    traversal: Traversal

    async def ask_and_finish(node, asked):
        answer = await net.ask(node, asked)
        traversal.finish(key)  # the first node answers with the value
        return answer

    table = net.tables[start_node.node_id]
    traversal = Traversal({key: table.get_nearest_neighbors(key, 20)}, ask_and_finish, beam_size=5, alpha=3,
                          hedge_after=1.0)
    results = run(traversal.run(timeout=5))
    assert results[key].requests == 1 and len(net.calls) == 1

    # the nearest node hangs: after the hedge delay the others are asked, and the lookup goes on
    # (it still waits for the hung node, which is among the nearest, until the deadline: §2.3)
    net.calls.clear()
    net.hung = {table.get_nearest_neighbors(key, 1)[0].node_id}
    started = time.monotonic()
    results = run(net.traversal(start_node, [key], beam_size=5, hedge_after=0.05).run(timeout=0.5))
    assert net.calls[0][0] in net.hung and len(net.calls) >= 5
    assert len(results[key].nearest) == 4 and results[key].timed_out
    assert not net.hung & {n.node_id for n in results[key].nearest}
    assert time.monotonic() - started < 10.0  # the deadline, not the hung node's hour (wide: a loaded CI)


def test_a_slow_node_frees_its_place_but_the_lookup_still_waits_for_it() -> None:
    """§2.3: a node that fails to answer quickly no longer holds an alpha slot, so the lookup asks
    others meanwhile; it still waits for that node, which may belong to the result, until the
    deadline (or its request fails), rather than settle for farther nodes."""
    net = Network(100, seed=18)
    key = DHTID.generate(rng=random.Random(19))
    start_node = net.nodes[-1]
    net.hung = set(net.nearest(key, 1, alive_only=False))
    stuck = run(net.traversal(start_node, [key], beam_size=5, alpha=1).run(timeout=0.3))
    assert stuck[key].requests == 1  # alpha = 1 and no slow_after: nothing but the hung node is asked
    net.calls.clear()
    results = run(net.traversal(start_node, [key], beam_size=5, alpha=1, slow_after=0.02).run(timeout=0.3))
    assert results[key].timed_out and results[key].requests > 5
    assert [n.node_id for n in results[key].nearest] == [
        i for i in net.nearest(key, 8) if i != start_node.node_id][:5]


def test_a_suspect_is_asked_but_not_waited_for_once_another_node_answered() -> None:
    """A node whose last request timed out (`is_suspect`; a crashed node that others still refer
    to) is asked like any other, but the lookup ends without it once other nodes answered, rather
    than wait out its request (before it did, every read near a crashed replica waited 3 s, round after
    round). Alone, with no answer from anyone else, it is still waited for (until the deadline)."""
    net = Network(100, seed=18)
    key = DHTID.generate(rng=random.Random(19))
    start_node = net.nodes[-1]
    net.hung = set(net.nearest(key, 2, alive_only=False))
    hung_peers = {n.peer_id for n in net.nodes if n.node_id in net.hung}
    waited = run(net.traversal(start_node, [key], beam_size=5, slow_after=0.02).run(timeout=0.3))
    assert waited[key].timed_out  # not suspected: the hung nodes may belong to the result
    net.calls.clear()
    adopted: list[asyncio.Task] = []

    async def lookup_then_check():
        found = await net.traversal(start_node, [key], beam_size=5, is_suspect=hung_peers.__contains__,
                                    adopt=adopted.append).run(timeout=5)
        # the suspects' requests go on (their timeouts still count against them), the others' ended
        running = [task for task in adopted if not task.done()]
        for task in adopted:
            task.cancel()
        return found, len(running)

    results, running = run(lookup_then_check())
    assert not results[key].timed_out
    assert {node_id for node_id, _ in net.calls} & net.hung == net.hung  # asked all the same
    assert running == len(adopted) == 2
    assert [n.node_id for n in results[key].nearest] == [
        i for i in net.nearest(key, 8) if i != start_node.node_id][:5]
    # nobody else answers: the suspect is all there is, and the lookup waits for it
    lonely = Network(3, seed=3)
    lonely.hung = {lonely.nodes[0].node_id}
    suspect = {lonely.nodes[0].peer_id}.__contains__
    initial = {key: [lonely.nodes[0]]}
    alone = run(Traversal(initial, lonely.ask, beam_size=5, alpha=3, is_suspect=suspect).run(timeout=0.2))
    assert alone[key].timed_out and alone[key].nearest == []


def test_disjoint_paths_find_the_true_nearest_and_ask_no_node_twice() -> None:
    net = Network(400, seed=16)
    rng = random.Random(17)
    keys = [DHTID.generate(rng=rng) for _ in range(10)]
    start = net.nodes[0]
    results = run(net.traversal(start, keys, disjoint_paths=3).run(timeout=10))
    for key in keys:
        expected = [i for i in net.nearest(key, 21) if i != start.node_id][:20]
        assert [n.node_id for n in results[key].nearest] == expected
        asked = [node for node, asked_keys in net.calls if key in asked_keys]
        assert len(asked) == len(set(asked)) == results[key].requests  # each node on one path only


def _colluding_liars(net: Network, key: DHTID, start: NodeInfo, count: int) -> set[DHTID]:
    """Makes the `count` nodes nearest to `key` liars known to `start` only through one of them:
    they answer every Find with one another (and never with an honest node); honest nodes do not
    know them."""
    liars = set(net.nearest(key, count))
    liar_infos = [n for n in net.nodes if n.node_id in liars]
    for node_id, table in net.tables.items():
        for liar in liars:
            if liar in table and node_id not in liars:
                table.remove(liar)
    first = min(liars, key=lambda i: i ^ key)
    net.tables[start.node_id].add_or_update(first, *next((n.peer_id, n.addr) for n in liar_infos if n.node_id == first))
    honest_ask = net.ask

    async def ask(node: NodeInfo, keys: list[DHTID]) -> Mapping[DHTID, Sequence[NodeInfo]] | None:
        if node.node_id in liars:
            net.calls.append((node.node_id, list(keys)))
            return {k: liar_infos for k in keys}
        return await honest_ask(node, keys)

    net.ask = ask  # type: ignore[method-assign]
    return liars


@pytest.mark.parametrize(("paths", "hidden"), [(1, True), (3, False)])
def test_liars_that_refer_only_to_one_another_hide_a_key_from_one_path_only(paths: int, hidden: bool) -> None:
    net = Network(300, seed=18)
    key = DHTID.generate(rng=random.Random(19))
    start = max(net.nodes, key=lambda n: n.node_id ^ key)
    liars = _colluding_liars(net, key, start, 20)
    holders = [i for i in net.nearest(key, 40) if i not in liars][:5]  # where the key's replicas live
    # alpha = 1: one request at a time per path, so which nodes a path meets first is fixed
    result = run(net.traversal(start, [key], alpha=1, disjoint_paths=paths).run(timeout=10))[key]
    asked = {node for node, asked_keys in net.calls if key in asked_keys}
    assert bool(asked & set(holders)) is not hidden
    assert not result.timed_out
