"""Matchmaking: leader election (static and DHT), group formation, Moshpit group keys.

The DHT is a tiny in-memory stand-in with the API `swarm.dht` offers on `peer.dht` (`avg_harness.FakeDHT`)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from avg_harness import FakeDHT, ValueWithExpiration, run_steps

from swarm.averaging import Action, Averager, AveragerConfig, FaultPlan, FaultPoint, MatchmakingConfig
from swarm.averaging.moshpit import moshpit_group_key, moshpit_next_coords
from swarm.averaging.parts import RoundFailed
from swarm.core.errors import AveragingError
from swarm.core.timeutil import get_dht_time
from swarm.dht import owner_marker
from swarm.peer import Peer


def test_moshpit_group_keys_mix_peers_across_rounds():
    grid = (4, 4)
    coords = {(x, y): [x, y] for x in range(4) for y in range(4)}
    # round 0 averages along dimension 0: peers sharing y group together, 4 groups of 4
    groups: dict[str, list] = {}
    for c, xy in coords.items():
        groups.setdefault(moshpit_group_key(0, xy), []).append(c)
    assert len(groups) == 4 and all(len(g) == 4 for g in groups.values())
    # after the round each takes its index in the group as its new x: the next round's groups
    # (along dimension 1) each hold peers from different round-0 groups
    new = {c: moshpit_next_coords(0, xy, i, grid) for g in groups.values() for i, c in enumerate(sorted(g))}
    groups1: dict[str, list] = {}
    for c, xy in new.items():
        groups1.setdefault(moshpit_group_key(1, xy), []).append(c)
    assert all(len({c[1] for c in g}) == 4 for g in groups1.values())


@pytest.mark.timeout(60)
def test_dht_matchmaking_forms_a_group_and_averages():
    dht = FakeDHT()
    peers = [Peer() for _ in range(3)] + [Peer(client_mode=True)]
    try:
        for p in peers:
            p.dht = dht
        tensors = [[torch.full((100,), float(i))] for i in range(4)]
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=0.2))
        avgs = [Averager(p, t, prefix="mm", target_group_size=4, config=config) for p, t in zip(peers, tensors)]
        results = run_steps(avgs, timeout=10)
        assert all(not isinstance(r, Exception) for r in results), results
        assert len({r.round_id for r in results}) == 1 and len(results[0].group) == 4
        assert peers[3].peer_id != results[0].group[0]  # a client-mode peer never leads
        for t in tensors:
            assert torch.allclose(t[0], torch.full((100,), 1.5))
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(60)
def test_dht_matchmaking_skips_a_dead_leader_and_starts_with_min_group_size():
    dht = FakeDHT()
    peers = [Peer() for _ in range(3)]
    try:
        for p in peers:
            p.dht = dht
        # a dead peer declared itself first: it would lead, but cannot be reached
        dead = Peer()
        dead_addr, dead_id = dead.addrs[0], dead.peer_id
        dead.shutdown()
        asyncio.run(dht.astore("mm.group.0", {"addr": dead_addr, "client_mode": False},
                               expiration_time=get_dht_time() + 1.0, subkey=owner_marker(dead_id)))
        tensors = [[torch.full((10,), float(i))] for i in range(3)]
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=0.2))
        avgs = [Averager(p, t, prefix="mm", target_group_size=5, min_group_size=3, config=config)
                for p, t in zip(peers, tensors)]
        results = run_steps(avgs, timeout=10)
        assert all(not isinstance(r, Exception) for r in results), results
        assert dead_id not in results[0].group and len(results[0].group) == 3
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(30)
def test_no_group_within_the_timeout_raises_and_leaves_tensors_alone():
    with Peer() as a:
        a.dht = FakeDHT()
        t = torch.ones(5)
        avg = Averager(a, [t], prefix="alone", target_group_size=2, min_group_size=2)
        with pytest.raises(AveragingError, match="no averaging group"):
            avg.step(timeout=1.0)
        assert torch.equal(t, torch.ones(5))


class _NotifyingDHT(FakeDHT):
    """`FakeDHT` whose `stored` condition is notified after every store."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = threading.Condition()

    async def astore(self, key: str, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        ok = await super().astore(key, value, expiration_time, subkey)
        with self.stored:
            self.stored.notify_all()
        return ok


@pytest.mark.timeout(60)
def test_the_members_of_a_failed_round_retry_it_together():
    """A round that failed is retried under the same key (an epoch) by its members. Each member's
    declaration still names the failed round (withdrawn when the group formed) until it declares
    again: that is not a group of the round that started without the others. A member that retries
    first waits for the rest, where it used to give up alone after 0.05 s ("started without this
    peer")."""
    dht = _NotifyingDHT()
    peers = [Peer() for _ in range(2)]
    try:
        for p in peers:
            p.dht = dht
        plans = [FaultPlan().add(FaultPoint.BEFORE_DECISION, Action.RAISE, rounds={0}) for _ in peers]
        tensors = [[torch.full((100,), float(i))] for i in range(2)]
        avgs = [Averager(p, t, prefix="retry", target_group_size=2, faults=plan)
                for p, t, plan in zip(peers, tensors, plans)]
        failed = run_steps(avgs, timeout=10, group_key="e0")
        assert all(isinstance(r, RoundFailed) for r in failed), failed

        def withdrawn() -> bool:  # both declarations name the failed round
            entries = dht.data.get("retry.group.e0", {}).values()
            return len(entries) == 2 and all("started" in e.value for e in entries)

        with dht.stored:  # the withdrawals are stores in the background: wait for them (bounded)
            assert dht.stored.wait_for(withdrawn, timeout=10), dht.data
        # the first member retries while the other's declaration still names the round they were in
        with pytest.raises(AveragingError) as alone:
            avgs[0].step(timeout=1.0, group_key="e0")
        assert "started without this peer" not in str(alone.value), alone.value
        assert "no averaging group formed within 1.0 s" in str(alone.value)
        # then both retry: one group of both, the tensors averaged
        results = run_steps(avgs, timeout=10, group_key="e0")
        assert all(not isinstance(r, Exception) for r in results), results
        assert len({r.round_id for r in results}) == 1 and len(results[0].group) == 2
        assert all(torch.allclose(t[0], torch.full((100,), 0.5)) for t in tensors)
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(30)
def test_abandoning_matchmaking_stops_a_step_that_is_still_looking():
    with Peer() as a:
        a.dht = FakeDHT()
        t = torch.ones(5)
        avg = Averager(a, [t], prefix="abandon", target_group_size=2, min_group_size=2)
        assert a.run(_abandon_soon(avg)) is False  # no step running: nothing to stop

        async def step_and_abandon() -> tuple[bool, BaseException | None]:
            declared = asyncio.Event()
            store = a.dht.astore

            async def astore(*args: Any, **kwargs: Any) -> bool:
                ok = await store(*args, **kwargs)
                declared.set()
                return ok

            a.dht.astore = astore
            step = asyncio.ensure_future(avg.astep(timeout=60.0))
            # the step is looking for a partner that never comes once it has declared itself
            await asyncio.wait_for(declared.wait(), 10)
            stopped = avg.abandon_matchmaking("the swarm moved on")
            error = (await asyncio.gather(step, return_exceptions=True))[0]
            return stopped, error

        stopped, error = a.run(step_and_abandon(), timeout=10)
        assert stopped and isinstance(error, AveragingError), error
        assert "stopped looking for a group: the swarm moved on" in str(error)
        assert torch.equal(t, torch.ones(5))
        # the next step is not affected by the earlier abandon
        with pytest.raises(AveragingError, match="no averaging group"):
            avg.step(timeout=0.5)


async def _abandon_soon(avg: Averager) -> bool:
    return avg.abandon_matchmaking("nothing to stop")


@pytest.mark.timeout(30)
def test_expected_size_starts_the_round_without_waiting_for_the_target():
    # target 4 and a 60 s join window: two peers would wait out the window, unless the step says
    # only two are expected (the test's 30 s bound fails if they wait)
    with Peer() as a, Peer() as b:
        dht = FakeDHT()
        a.dht = b.dht = dht
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=60.0, matchmaking_share=0.9))
        avgs = [Averager(p, [torch.full((4,), float(i))], prefix="exp", target_group_size=4, min_group_size=2,
                         config=config) for i, p in enumerate((a, b))]
        out = run_steps(avgs, timeout=100.0, expected_size=2)
        assert all(not isinstance(r, Exception) and len(r.group) == 2 for r in out), out
        assert all(torch.equal(avg.tensors[0], torch.full((4,), 0.5)) for avg in avgs)


@pytest.mark.timeout(30)
def test_static_group_refuses_peers_with_other_tensors():
    with Peer() as a, Peer() as b:
        addrs = [a.addrs[0], b.addrs[0]]
        avg_a = Averager(a, [torch.zeros(4)], initial_group=addrs, target_group_size=2)
        avg_b = Averager(b, [torch.zeros(5)], initial_group=addrs, target_group_size=2)
        results = run_steps([avg_a, avg_b], timeout=2.0)
        assert all(isinstance(r, AveragingError) for r in results), results


@pytest.mark.timeout(90)
def test_real_dht_matchmaking_with_real_peers():
    """Integration: peers find each other through `swarm.dht` (peer.dht), no addresses given."""
    pytest.importorskip("swarm.dht.node")
    first = Peer()
    peers = [first] + [Peer(initial_peers=first.addrs) for _ in range(2)] + [
        Peer(initial_peers=first.addrs, client_mode=True)]
    try:
        assert all(p.dht is not None for p in peers)
        tensors = [[torch.full((1000,), float(i))] for i in range(4)]
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=0.5))
        avgs = [Averager(p, t, prefix="dhtmm", target_group_size=4, config=config) for p, t in zip(peers, tensors)]
        for _ in range(2):
            results = run_steps(avgs, timeout=15)
            assert all(not isinstance(r, Exception) for r in results), results
            assert len({r.round_id for r in results}) == 1 and len(results[0].group) == 4
            for t in tensors:
                assert torch.allclose(t[0], torch.full((1000,), 1.5))
    finally:
        for p in reversed(peers):
            p.shutdown()


class _SlowReads:
    """One peer's view of a shared `FakeDHT` whose reads take `delay` seconds (they wait out a
    crashed replica it has not met yet) and whose peer has seen nodes die (`read_patience`)."""

    def __init__(self, dht: FakeDHT, delay: float, patience: float) -> None:
        self.dht, self.delay, self.patience = dht, delay, patience

    async def astore(self, *args: Any, **kwargs: Any) -> bool:
        return await self.dht.astore(*args, **kwargs)

    async def aget(self, key: str, latest: bool = False) -> ValueWithExpiration | None:
        await asyncio.sleep(self.delay)
        return await self.dht.aget(key, latest)

    def read_patience(self) -> float:
        return self.patience


@pytest.mark.timeout(60)
@pytest.mark.parametrize("patience", [2.0, 0.0])
def test_a_leader_that_saw_nodes_die_waits_for_a_follower_still_reading_past_them(patience):
    """After crashes, a leader whose own reads pass over the dead nodes (it saw them
    time out) is quick, while a follower that has not met them yet spends a request timeout on
    its first read. With the DHT's `read_patience` added to its wait bound the leader takes the
    follower in (one group of 3); with none it starts without it (0.3 s bound), as before."""
    shared = FakeDHT()
    peers = [Peer() for _ in range(3)]
    try:
        views = [_SlowReads(shared, 0.0, patience), _SlowReads(shared, 0.0, patience), _SlowReads(shared, 1.5, patience)]
        for p, view in zip(peers, views):
            p.dht = view
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=0.1, min_wait=0.05, max_wait=0.3))
        avgs = [Averager(p, [torch.full((4,), float(i))], prefix="slow", target_group_size=3, min_group_size=2,
                         config=config) for i, p in enumerate(peers)]
        out: list[Any] = [None] * 3

        def step(i: int, timeout: float) -> None:
            try:
                out[i] = avgs[i].step(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - inspected below
                out[i] = e

        # the slow reader's declaration expires last: it never leads
        threads = [threading.Thread(target=step, args=(i, t)) for i, t in ((0, 5.0), (1, 5.0), (2, 6.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        sizes = [len(r.group) if not isinstance(r, Exception) else 0 for r in out[:2]]
        if patience:
            assert all(not isinstance(r, Exception) for r in out), out
            assert sizes == [3, 3]
            assert all(torch.equal(a.tensors[0], torch.full((4,), 1.0)) for a in avgs)
        else:
            assert sizes == [2, 2]  # the follower still reading came too late
    finally:
        for p in peers:
            p.shutdown()
