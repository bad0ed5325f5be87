"""Followers that go straight to their last group's leader (`MatchmakingConfig.follow_last_leader`).

Where each step's group key names a round (as `swarm.Optimizer` gives each epoch), a round's group
is most often the last one's. Its followers then join the last leader directly, without declaring
themselves or reading the declarations in the DHT, and fall back to the DHT whenever that leader
does not take them. Real peers on loopback; the DHT is `avg_harness.FakeDHT`, shared, with one
view per peer that counts what that peer stored and read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest
import torch
from avg_harness import FakeDHT, run_steps

from swarm.averaging import Averager, AveragerConfig, MatchmakingConfig
from swarm.averaging.service import JOIN
from swarm.averaging.timing import ArrivalSpread
from swarm.peer import Peer
from swarm.proto import averaging_pb2

PREFIX = "mm"


class View:
    """One peer's access to the shared `FakeDHT`: counts its stores and reads per key, and sets
    `stored[key]` once it stored under `key`."""

    def __init__(self, dht: FakeDHT) -> None:
        self.dht = dht
        self.stores: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        self.stored: dict[str, threading.Event] = {}

    def event(self, key: str) -> threading.Event:
        return self.stored.setdefault(key, threading.Event())

    async def astore(self, key: str, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        self.stores[key] = self.stores.get(key, 0) + 1
        ok = await self.dht.astore(key, value, expiration_time, subkey)
        self.event(key).set()
        return ok

    async def aget(self, key: str, latest: bool = False) -> Any:
        self.reads[key] = self.reads.get(key, 0) + 1
        return await self.dht.aget(key, latest)

    def read_patience(self) -> float:
        return 0.0


@pytest.fixture
def make():
    """Builds `n` peers on one shared `FakeDHT` (a counting `View` each) with an averager each;
    shuts every peer down at the end."""
    made: list[Peer] = []

    def build(n: int, max_wait: float = 5.0) -> tuple[list[Peer], list[View], list[Averager]]:
        dht = FakeDHT()
        peers = [Peer() for _ in range(n)]
        made.extend(peers)
        views = [View(dht) for _ in peers]
        for p, v in zip(peers, views):
            p.dht = v
        config = AveragerConfig(matchmaking=MatchmakingConfig(join_window=0.2, follow_last_leader=True,
                                                              max_wait=max_wait))
        avgs = [Averager(p, [torch.full((64,), float(i))], prefix=PREFIX, target_group_size=n, config=config)
                for i, p in enumerate(peers)]
        return peers, views, avgs

    yield build
    for p in made:
        p.shutdown()


def first_round(avgs: list[Averager]) -> str:
    """Round "0" through the DHT; returns its leader's PeerID."""
    out = run_steps(avgs, timeout=10, group_key="0", expected_size=len(avgs))
    assert all(not isinstance(r, Exception) for r in out), [repr(r) for r in out if isinstance(r, Exception)]
    assert len({r.round_id for r in out}) == 1 and len(out[0].group) == len(avgs)
    return out[0].group[0]


def step_in_background(avg: Averager, timeout: float, key: str, expected: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Starts `avg.step` for group `key` in a thread; its result (or the exception it raised) lands
    in the returned dict under "out"."""
    result: dict[str, Any] = {}

    def step() -> None:
        try:
            result["out"] = avg.step(timeout=timeout, group_key=key, expected_size=expected)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            result["out"] = e

    thread = threading.Thread(target=step)
    thread.start()
    return thread, result


@pytest.mark.timeout(60)
def test_followers_of_the_last_group_go_straight_to_its_leader_without_the_dht(make):
    peers, views, avgs = make(3)
    leader = first_round(avgs)
    out = run_steps(avgs, timeout=10, group_key="1", expected_size=3)
    assert all(not isinstance(r, Exception) for r in out), out
    assert len({r.round_id for r in out}) == 1 and out[0].group[0] == leader and len(out[0].group) == 3
    key = f"{PREFIX}.group.1"
    for p, v in zip(peers, views):
        # its followers neither declare nor read (the leader does only if one of them was not in
        # a couple of round trips after its step: test_a_leader_holding_its_last_group_again_...)
        if p.peer_id != leader:
            assert v.stores.get(key, 0) == 0 and v.reads.get(key, 0) == 0, (v.stores, v.reads)
    for avg in avgs:  # both rounds averaged: the mean of 0, 1, 2 both times
        assert torch.equal(avg.tensors[0], torch.full((64,), 1.0))


def hold(peer: Peer, avg: Averager, key: str, count: int) -> None:
    """Returns once `avg`'s matchmaking holds `count` joins for group `key` (10 s at most)."""
    matchmaking = avg.matchmaking

    async def held() -> None:
        while sum(j.key == key and not j.answer.done() for j in matchmaking._joiners.values()) < count:
            matchmaking._arrived.clear()
            await matchmaking._arrived.wait()

    peer.run(asyncio.wait_for(held(), 10), timeout=15)


@pytest.mark.timeout(60)
def test_a_leader_holding_its_last_group_again_starts_without_the_dht(make):
    peers, views, avgs = make(3)
    leader = first_round(avgs)
    lead = next(i for i, p in enumerate(peers) if p.peer_id == leader)
    steps = [step_in_background(a, 20, "1", 3) for i, a in enumerate(avgs) if i != lead]
    hold(peers[lead], avgs[lead], "1", 2)  # both members came straight before the leader's step
    got = avgs[lead].step(timeout=10, group_key="1", expected_size=3)
    for thread, _ in steps:
        thread.join(30)
    outs = [result["out"] for _, result in steps]
    assert all(not isinstance(r, Exception) for r in outs), outs
    assert {got.round_id} == {r.round_id for r in outs} and len(got.group) == 3 and got.group[0] == leader
    # nobody declared, read or withdrew anything under the round's key
    assert all(v.stores.get(f"{PREFIX}.group.1", 0) == 0 and v.reads.get(f"{PREFIX}.group.1", 0) == 0
               for v in views), [(v.stores, v.reads) for v in views]
    assert avgs[lead].matchmaking.last_start["why"] == "every expected peer came straight"
    for avg in avgs:
        assert torch.equal(avg.tensors[0], torch.full((64,), 1.0))


@pytest.mark.timeout(60)
def test_a_leader_whose_member_is_late_declares_and_still_takes_it(make):
    peers, views, avgs = make(3)
    leader = first_round(avgs)
    lead = next(i for i, p in enumerate(peers) if p.peer_id == leader)
    early, late = (i for i in range(3) if i != lead)
    # the leader waits a few round trips for a straight member before it declares, then up to 5 s
    # (it starts as soon as the late member is in)
    avgs[lead].matchmaking.spread = ArrivalSpread(initial=5.0, floor=5.0, cap=5.0)
    first = step_in_background(avgs[early], 20, "1", 3)
    head = step_in_background(avgs[lead], 20, "1", 3)
    # the late member steps only once the leader, not holding it, declared in the DHT
    assert views[lead].event(f"{PREFIX}.group.1").wait(10)
    got = avgs[late].step(timeout=10, group_key="1", expected_size=3)
    for thread, _ in (first, head):
        thread.join(30)
    outs = [first[1]["out"], head[1]["out"]]
    assert all(not isinstance(r, Exception) for r in outs), outs
    assert {got.round_id} == {r.round_id for r in outs} and len(got.group) == 3 and got.group[0] == leader
    assert views[late].stores.get(f"{PREFIX}.group.1", 0) == 0  # it still came straight


@pytest.mark.timeout(60)
def test_a_member_that_never_comes_costs_its_leader_one_wait_bound(make):
    # the short wait for straight members and the wait for undeclared ones after declaring are one
    peers, views, avgs = make(3)
    leader = first_round(avgs)
    lead = next(i for i, p in enumerate(peers) if p.peer_id == leader)
    present = next(i for i in range(3) if i != lead)  # the third member trains on, never stepping
    matchmaking = avgs[lead].matchmaking
    matchmaking.spread = ArrivalSpread(initial=3.0, floor=3.0, cap=3.0)
    # its wait for straight members ~2 s (min_wait + 2 RTT), then declared, until 3 s from its step
    matchmaking.config = dataclasses.replace(matchmaking.config, min_wait=2.0)
    follower = step_in_background(avgs[present], 20, "1", 3)
    began = time.monotonic()
    got = avgs[lead].step(timeout=20, group_key="1", expected_size=3)
    took = time.monotonic() - began
    follower[0].join(30)
    assert not isinstance(follower[1]["out"], Exception), follower[1]
    assert got.round_id == follower[1]["out"].round_id and len(got.group) == 2
    assert views[lead].stores.get(f"{PREFIX}.group.1", 0) >= 1  # it declared once its wait for straight members passed
    assert took < 4.0, f"the leader waited {took:.1f} s for the missing member, its bound 3 s (5 s: two waits)"


@pytest.mark.timeout(60)
def test_a_leader_expecting_a_peer_its_last_group_lacked_declares_at_once(make):
    # a newcomer finds a leader only through the DHT: the leader declares without waiting (were
    # it to wait for straight members first, its ~30 s wait would outlast the steps' 10 s)
    peers, views, avgs = make(3, max_wait=30.0)
    leader = first_round(avgs[:2])
    for avg in avgs:
        avg.matchmaking.spread = ArrivalSpread(initial=30.0, floor=30.0, cap=30.0)
        avg.matchmaking.config = dataclasses.replace(avg.matchmaking.config, min_wait=30.0)
    out = run_steps(avgs, timeout=10, group_key="1", expected_size=3)
    assert all(not isinstance(r, Exception) for r in out), out
    assert len({r.round_id for r in out}) == 1 and len(out[0].group) == 3
    lead = next(i for i, p in enumerate(peers) if p.peer_id == leader)
    assert views[lead].stores.get(f"{PREFIX}.group.1", 0) >= 1
    assert avgs[lead].matchmaking.last_start.get("why") != "every expected peer came straight"


@pytest.mark.timeout(60)
def test_a_follower_whose_last_leader_is_gone_finds_the_group_through_the_dht(make):
    peers, views, avgs = make(3)
    leader = first_round(avgs)
    gone = next(i for i, p in enumerate(peers) if p.peer_id == leader)
    avgs[gone].shutdown()
    peers[gone].shutdown()
    rest = [a for i, a in enumerate(avgs) if i != gone]
    out = run_steps(rest, timeout=10, group_key="1", expected_size=2)
    assert all(not isinstance(r, Exception) for r in out), out
    assert len({r.round_id for r in out}) == 1 and len(out[0].group) == 2 and leader not in out[0].group
    # its followers declared themselves once the last leader did not answer
    assert all(views[i].stores.get(f"{PREFIX}.group.1", 0) >= 1 for i in range(3) if i != gone)


@pytest.mark.timeout(60)
def test_a_join_for_the_next_round_waits_for_the_leaders_step(make):
    peers, views, avgs = make(2)
    leader = first_round(avgs)
    lead, follow = (0, 1) if peers[0].peer_id == leader else (1, 0)
    matchmaking = avgs[lead].matchmaking

    async def forget_arrivals() -> None:  # the last round's arrivals may have left it set
        matchmaking._arrived.clear()

    peers[lead].run(forget_arrivals())
    thread, result = step_in_background(avgs[follow], 20, "1", 2)
    # the follower's join reaches the leader before the leader's own step for round "1" began
    peers[lead].run(asyncio.wait_for(matchmaking._arrived.wait(), 10), timeout=15)
    assert any(j.key == "1" for j in matchmaking._joiners.values())
    got = avgs[lead].step(timeout=10, group_key="1", expected_size=2)
    thread.join(30)
    assert not isinstance(result["out"], Exception), result
    assert got.round_id == result["out"].round_id and got.group[0] == leader
    assert views[follow].stores.get(f"{PREFIX}.group.1", 0) == 0


@pytest.mark.timeout(60)
def test_a_leader_that_does_not_step_holds_its_followers_at_most_max_wait(make):
    # the last leader trains on but never steps for round "1": its followers are held at most
    # max_wait, then form the round's group through the DHT without it. max_wait is also how long
    # round "0"'s leader waits for a declared peer before any arrival was seen: 2 s, far from what
    # a pause of a loaded test process makes, and far below the followers' 10 s
    peers, _, avgs = make(3, max_wait=2.0)
    leader = first_round(avgs)
    rest = [a for a, p in zip(avgs, peers) if p.peer_id != leader]
    out = run_steps(rest, timeout=10, group_key="1", expected_size=2)
    assert all(not isinstance(r, Exception) for r in out), out
    assert len({r.round_id for r in out}) == 1 and len(out[0].group) == 2 and leader not in out[0].group


@pytest.mark.timeout(60)
def test_a_join_for_another_round_is_refused_never_put_in_this_rounds_group(make):
    peers, views, avgs = make(2)
    with Peer() as stranger:
        leader = first_round(avgs)
        lead, follow = (0, 1) if peers[0].peer_id == leader else (1, 0)
        thread, result = step_in_background(avgs[lead], 20, "1", 2)
        # the leader is in its step for round "1" once it declared under that key
        assert views[lead].event(f"{PREFIX}.group.1").wait(10)
        channel = stranger.pool.get(peers[lead].addrs[0])
        matchmaking = avgs[lead].matchmaking

        def join(key: str) -> averaging_pb2.JoinResponse:
            me = averaging_pb2.AvgMember(peer_id=stranger.peer_id, addr=stranger.addrs[0], weight=1.0, bandwidth=1.0)
            request = averaging_pb2.JoinRequest(prefix=PREFIX, group_key=key, schema=matchmaking.schema,
                                                numel=matchmaking.numel, member=me, timeout=5.0)
            return stranger.run(channel.unary(JOIN, request, averaging_pb2.JoinResponse, timeout=5.0), timeout=10)

        late = join("0")  # a latecomer for the round that already averaged
        # it names the round the latecomer missed, so a follower can tell it from another round's
        assert not late.accepted and late.reason.startswith("group started") and late.started_group_key == "0", late
        other = join("7")
        assert not other.accepted and "looks for the group of '1'" in other.reason, other
        assert other.started_group_key == "", other
        got = avgs[follow].step(timeout=10, group_key="1", expected_size=2)
        thread.join(30)
        assert not isinstance(result["out"], Exception), result
        assert stranger.peer_id not in got.group and len(got.group) == 2


@pytest.mark.timeout(60)
def test_a_last_leader_that_holds_no_joins_is_found_again_through_the_dht(make):
    """A leader that does not hold joins for its next round (the setting off, as on a peer of an
    earlier version) answers "group started" for its last round, not the follower's: that sends
    the follower to the DHT without counting against it, and they form the round's group together."""
    peers, views, avgs = make(2)
    leader = first_round(avgs)
    lead, follow = (0, 1) if peers[0].peer_id == leader else (1, 0)
    matchmaking = avgs[lead].matchmaking
    matchmaking.config = dataclasses.replace(matchmaking.config, follow_last_leader=False)
    thread, result = step_in_background(avgs[follow], 20, "1", 2)
    # the follower was turned away and declared itself in the DHT before the leader steps
    assert views[follow].event(f"{PREFIX}.group.1").wait(10)
    got = avgs[lead].step(timeout=10, group_key="1", expected_size=2)
    thread.join(30)
    assert not isinstance(result["out"], Exception), result
    assert got.round_id == result["out"].round_id and len(got.group) == 2
