"""Round deadlines follow what rounds take, with real peers (in-process, real gRPC and bulk streams).

A slow link is made with the reducer's fault hook (a delay on every chunk it receives). The
round's timeout, written into the group by its leader, starts as a small multiple of the fast
rounds; when the link slows down the rounds that no longer fit fail alike on every member and
the timeout backs off until they fit; it never becomes the step's whole timeout. A stalled
member then costs the survivors about that timeout, not the step's.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from avg_harness import run_steps

from swarm.averaging import (
    Action,
    AllReduceConfig,
    Averager,
    AveragerConfig,
    FaultPlan,
    FaultPoint,
    MatchmakingConfig,
)
from swarm.peer import Peer

STEP_TIMEOUT = 60.0


@pytest.mark.timeout(240)
def test_round_timeout_follows_a_slow_link_and_bounds_what_a_stalled_peer_costs():
    peers = [Peer() for _ in range(3)]
    try:
        addrs = [p.addrs[0] for p in peers]
        plans = [FaultPlan() for _ in peers]
        config = AveragerConfig(allreduce=AllReduceConfig(chunk_bytes=16384),
                                matchmaking=MatchmakingConfig(min_round_timeout=0.5))
        avgs = [Averager(p, [torch.full((200_000,), float(i))], prefix="dl", target_group_size=3,
                         initial_group=addrs, config=config, faults=plan)
                for i, (p, plan) in enumerate(zip(peers, plans))]
        leader = min(avgs, key=lambda a: a.peer.peer_id)
        slow = next(i for i, a in enumerate(avgs) if a is not leader)

        def round_(r: int) -> list:
            for i, a in enumerate(avgs):
                a.tensors[0].fill_(float(i))
            return run_steps(avgs, timeout=STEP_TIMEOUT)

        for r in range(3):
            out = round_(r)
            assert all(not isinstance(x, Exception) and len(x.contributors) == 3 for x in out), out
        fast_timeout = leader.matchmaking.last_start["round_timeout"]
        assert fast_timeout < 10.0, leader.matchmaking.last_start  # from measurement, not the step's 60 s

        # the link into one reducer slows down: 20 ms per chunk it receives (~30 chunks a round)
        plans[slow].add(FaultPoint.AFTER_CHUNKS_RECEIVED, Action.DELAY, times=100_000, seconds=0.02)
        outcomes: list[bool] = []
        for r in range(3, 12):
            started = time.monotonic()
            out = round_(r)
            ok = [not isinstance(x, Exception) for x in out]
            assert all(ok) or not any(ok), out  # every member applies a round, or none does
            assert time.monotonic() - started < STEP_TIMEOUT / 2, out
            # a round that had to leave senders out ("too late") did not fit its deadline either
            outcomes.append(all(ok) and all(len(x.contributors) == 3 for x in out))
            if outcomes[-2:] == [True, True]:
                break
        assert outcomes[-2:] == [True, True], outcomes  # the deadline caught up with the slower link
        slow_figures = leader.matchmaking.last_start
        slow_round = leader.matchmaking.timing.durations[-1]
        assert slow_figures["round_timeout"] >= slow_round, slow_figures
        assert slow_figures["round_timeout"] > fast_timeout and slow_figures["round_timeout"] < STEP_TIMEOUT / 2
        assert all(torch.allclose(a.tensors[0], torch.full((200_000,), 1.0)) for a in avgs)

        # a member that stalls (stops sending for 20 s) costs the others about the round's timeout
        stalled = next(i for i, a in enumerate(avgs) if a is not leader and i != slow)
        plans[stalled].add(FaultPoint.BEFORE_REDUCE_SCATTER, Action.DELAY, seconds=20.0,
                           rounds={plans[stalled].round_index})
        out: list = [None] * len(avgs)
        finished: dict[int, float] = {}

        def run(i: int) -> None:
            try:
                out[i] = avgs[i].step(timeout=STEP_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - inspected below
                out[i] = e
            finished[i] = time.monotonic()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(avgs))]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(STEP_TIMEOUT + 10)
        survivors = [i for i in range(len(avgs)) if i != stalled]
        cost = max(finished[i] for i in survivors) - started
        # the round's timeout (a multiple of the measured round) bounds it, far below the 20 s stall
        assert cost <= slow_figures["round_timeout"] * 1.5 + 2.0, (cost, slow_figures, out)
        oks = [not isinstance(out[i], Exception) for i in survivors]
        assert all(oks) or not any(oks), out
        if all(oks):
            assert stalled not in {avgs.index(a) for a in avgs if a.peer.peer_id in out[survivors[0]].contributors}
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(60)
def test_a_decision_later_than_sender_timeout_does_not_make_members_fetch_every_part_again():
    """A reduce-scatter (here: the leader's decision) that takes longer than `sender_timeout` is no
    silence of the reducers: none can send a result before the decision. Found in the network lab
    (benchmarks/history/BENCHMARKS-2026-12-05.md, scenario 3), where every member fetched every part a second time over a slow link."""
    from swarm.metrics import REGISTRY

    def stalled_fetches() -> float:
        return REGISTRY.value("swarm_averaging_part_fetches_total", why="stalled") or 0.0

    peers = [Peer() for _ in range(3)]
    try:
        addrs = [p.addrs[0] for p in peers]
        config = AveragerConfig(allreduce=AllReduceConfig(chunk_bytes=16384, sender_timeout=0.5))
        # only the leader reaches BEFORE_DECISION: it decides 1.5 s (3 sender timeouts) late
        plans = [FaultPlan().add(FaultPoint.BEFORE_DECISION, Action.DELAY, seconds=1.5) for _ in peers]
        avgs = [Averager(p, [torch.full((100_000,), float(i))], prefix="late-decision", target_group_size=3,
                         initial_group=addrs, config=config, faults=plan)
                for i, (p, plan) in enumerate(zip(peers, plans))]
        before = stalled_fetches()
        out = run_steps(avgs, timeout=30.0)
        assert all(not isinstance(x, Exception) and len(x.contributors) == 3 for x in out), out
        assert sum(plan.faults[0].fired for plan in plans) == 1
        assert stalled_fetches() == before  # every part came on its own stream
        assert all(torch.allclose(a.tensors[0], torch.full((100_000,), 1.0)) for a in avgs)
    finally:
        for p in peers:
            p.shutdown()


def test_a_streaming_peer_may_stay_silent_a_multiple_of_its_own_links_chunk_time():
    """Pure logic: each peer's silence limit follows its own link estimates, between a floor and
    the round's sender_timeout (a link never measured gets the cap)."""
    from swarm.averaging.allreduce import SILENCE_FLOOR, SILENCE_MULTIPLE, silence_limit
    from swarm.net.estimates import LinkEstimates

    est = LinkEstimates()
    chunk = 1 << 20
    assert silence_limit(est, "never-seen", chunk, cap=5.0) == 5.0
    for _ in range(8):
        est.observe_rtt("lan", 0.001)
        est.observe_rtt("wan", 0.05)
        est.observe_rtt("modem", 0.2)
    est.observe_transfer("lan", 100 << 20, 0.1)    # ~1 GB/s
    est.observe_transfer("wan", 50 << 20, 20.0)    # ~2.6 MB/s
    est.observe_transfer("modem", 1 << 20, 10.0)   # ~100 KB/s
    lan, wan, modem = (silence_limit(est, p, chunk, cap=5.0) for p in ("lan", "wan", "modem"))
    assert lan == SILENCE_FLOOR
    expected_wan = SILENCE_MULTIPLE * est.expected_time("wan", chunk)
    assert wan == pytest.approx(expected_wan) and SILENCE_FLOOR < wan < 5.0
    assert modem == 5.0  # a chunk takes ~10 s there: the round's limit caps it
    assert silence_limit(est, "wan", chunk, cap=0.5) == 0.5  # the cap wins over the floor


@pytest.mark.timeout(150)
def test_a_killed_reducer_is_found_gone_from_its_refused_port_instead_of_waited_for():
    """A follower SIGKILLed mid reduce-scatter leaves its port closed: the member whose stream to it
    broke probes the address, gets a refusal, and its reducer reports at once; the leader, told of
    the broken stream, probes too and decides without the dead reducer's report instead of waiting
    for the decide deadline (the round's timeout is 8 s here, so without the probes the reason
    would be a plain "did not report"). Every survivor fails alike with the reason, untouched, and
    the survivors then average."""
    from avg_harness import ProcessGroup, check_agreement

    cfgs = [{"index": i, "seed": 7, "numel": 20_000, "chunk_bytes": 4096, "sender_timeout": 5.0,
             "min_round_timeout": 8.0, "debug_log": True} for i in range(4)]
    with ProcessGroup(cfgs, min_size=2) as group:
        assert check_agreement(group.round(0, timeout=30), 30) == "ok"
        servers = [w.index for w in sorted(group.workers, key=lambda w: w.peer_id)]  # the first leads

        def logs() -> str:  # the survivors' debug logs (who probed whom, when the leader decided)
            return "\n".join(f"--- worker {w.index}:\n{w.log(12_000)}" for w in group.workers if w.index != victim)

        victim = servers[-1]
        # killed as its reducer takes its first chunk, so it never reports (killed at its own first
        # chunk sent, it could report first and then die: a round that fails, rightly, on its lost
        # part, in ~1 of 6 runs on a quiet machine)
        group.workers[victim].send({"cmd": "arm", "faults": [{"point": "after_chunks_received", "action": "kill",
                                                              "after": 1}]})
        results = group.round(1, timeout=30)
        assert results[victim] is None, "the victim should have died"
        assert check_agreement(results, 30) == "failed", results
        survivors = [result for index, result in results.items() if index != victim]
        assert all(result is not None for result in survivors), results
        # the survivors that learned of the failure first name the refusal (without the probes: a
        # plain "did not report"); a member whose own reducer the leader's failed decision closed
        # first may name that instead ("the peer is shutting down", seen once under CI load)
        messages = [result["message"] for result in survivors]
        assert any("refused connections" in m for m in messages), f"{messages}\n{logs()}"
        assert all("refused connections" in m or "shutting down" in m for m in messages), f"{messages}\n{logs()}"
        assert check_agreement(group.round(2, timeout=30), 30) == "ok"
