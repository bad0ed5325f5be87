"""Averaging with real peer processes: exact means, client-mode and auxiliary peers, and real
SIGKILL / SIGSTOP of a peer at chosen moments of a round (fired by the peer's own fault plan)."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import pytest
from avg_harness import ProcessGroup, check_agreement

# 20,000 floats in 4 KiB chunks: every part spans several chunks, so faults land mid-stream
SMALL = {"numel": 20_000, "chunk_bytes": 4096, "sender_timeout": 1.0}


def configs(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"index": i, "seed": 7, **SMALL, **extra} for i in range(n)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2])  # 4 peers: the clean rounds of test_sigstop_mid_round
def test_exact_weighted_mean(n):
    with ProcessGroup(configs(n)) as group:
        for r in range(2):
            results = group.round(r, timeout=10)
            assert check_agreement(results, 10) == "ok"
            assert all(len(res["contributors"]) == n for res in results.values())


@pytest.mark.timeout(120)
def test_eight_peers_with_client_mode_and_auxiliary_peers():
    cfgs = configs(8, numel=4000)
    cfgs[3]["client_mode"] = True
    cfgs[6]["client_mode"] = True
    cfgs[7]["auxiliary"] = True
    with ProcessGroup(cfgs) as group:
        results = group.round(0, timeout=15)
        assert check_agreement(results, 15) == "ok"
        contributors = set(results[0]["contributors"])
        ids = {w.index: w.peer_id for w in group.workers}
        assert contributors == {ids[i] for i in range(7)}  # the auxiliary peer has no tensors


def _servers_by_id(group: ProcessGroup, alive: set[int]) -> list[int]:
    """Server-mode worker indices, smallest PeerID (the static group's leader) first."""
    return [w.index for w in sorted(group.workers, key=lambda w: w.peer_id)
            if not w.config.get("client_mode") and w.index in alive]


@pytest.mark.timeout(150)
def test_sigkill_at_each_moment_of_a_round():
    """One group, one peer SIGKILLed per round at a different moment: before the reduce-scatter,
    mid reduce-scatter (sender and reducer side), mid all-gather, and the leader before deciding.
    Every survivor returns within timeout + 1 s with the same exact mean of the same
    contributors, or every survivor fails with its tensors untouched; the rest go on averaging."""
    cfgs = configs(7)
    cfgs[6]["client_mode"] = True
    timeout = 4.0
    with ProcessGroup(cfgs) as group:
        alive = set(range(7))
        assert check_agreement(group.round(0, timeout=10), 10) == "ok"
        rng = random.Random(os.environ.get("SWARM_FAULT_SEED", "kill"))
        scenarios = [  # moments within a phase are drawn at random (seeded): chunk counts
            ("follower", "before_reduce_scatter", 0),
            ("client", "after_chunks_sent", rng.randint(1, 8)),
            ("follower", "after_chunks_received", rng.randint(1, 15)),
            ("follower", "during_all_gather", rng.randint(1, 8)),
            ("leader", "before_decision", 0),
        ]
        outcomes = []
        for r, (role, point, after) in enumerate(scenarios, start=1):
            servers = _servers_by_id(group, alive)
            victim = {"leader": servers[0], "follower": servers[-1], "client": 6}[role]
            group.workers[victim].send({"cmd": "arm", "faults": [{"point": point, "action": "kill", "after": after}]})
            results = group.round(r, timeout=timeout)
            assert results[victim] is None, f"{point}: the victim should have died"
            alive.discard(victim)
            outcomes.append(check_agreement(results, timeout))
        # the two survivors still average
        assert check_agreement(group.round(len(scenarios) + 1, timeout=10), 10) == "ok"
        assert "ok" in outcomes  # a dead client-mode sender is only left out


@pytest.mark.timeout(150)
def test_sigstop_mid_round():
    """A peer SIGSTOPped mid-round counts as failed: the others finish within timeout + 1 s and
    agree; once resumed (SIGCONT) it raises instead of applying, and rejoins the next round."""
    cfgs = configs(4)
    cfgs[3]["client_mode"] = True
    timeout = 4.0
    with ProcessGroup(cfgs, min_size=4) as group:  # everyone is in every round
        assert check_agreement(group.round(0, timeout=10), 10) == "ok"
        scenarios = [("before_reduce_scatter", 0), ("after_chunks_sent", 3), ("during_all_gather", 2)]
        for r, (point, after) in enumerate(scenarios, start=1):
            victim = _servers_by_id(group, set(range(4)))[-1]
            w = group.workers[victim]
            w.send({"cmd": "arm", "faults": [{"point": point, "action": "stop", "after": after}]})
            results = group.round(r, timeout=timeout, skip={victim})
            outcome = check_agreement(results, timeout)
            with pytest.raises(TimeoutError):
                w.next_event(0.2)  # still stopped
            w.signal(signal.SIGCONT)
            late = w.next_event(20)
            assert late is not None and late["event"] == "result", late
            if late["ok"]:  # resumed before its deadline: it must hold what the others hold
                survivor = next(r for r in results.values() if r is not None)  # the victim may be worker 0
                assert outcome == "ok" and late["round_id"] == survivor["round_id"], (late, results)
                assert late["digest"] == survivor["digest"], (late, results)
            else:
                assert late["untouched"], late
        assert check_agreement(group.round(len(scenarios) + 1, timeout=10), 10) == "ok"
