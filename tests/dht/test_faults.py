"""Tests for swarm.core.faults (link faults): the link faults a simulation injects into the protocol's calls."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm.core.errors import DeadlineExceeded, PeerUnreachable
from swarm.core.faults import FaultPlan, LinkFault


def test_a_healthy_plan_adds_nothing() -> None:
    plan = FaultPlan()
    assert asyncio.run(plan.apply("a", "b", 1.0)) == 0.0
    assert plan.stats.calls == 1 and plan.stats.lost == plan.stats.refused == plan.stats.delayed == 0


def test_refused_links_fail_at_once_and_lost_requests_after_their_timeout() -> None:
    plan = FaultPlan()
    plan.set_peer("dead", LinkFault(refuse=True))
    plan.set_link("a", "hole", LinkFault(loss=1.0))
    with pytest.raises(PeerUnreachable):
        asyncio.run(plan.apply("a", "dead", 1.0))
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        asyncio.run(plan.apply("a", "hole", 0.1))
    assert 0.09 <= time.monotonic() - start < 5.0  # waited its timeout, and no longer (wide: a loaded CI)
    assert asyncio.run(plan.apply("b", "hole", 0.1)) == 0.0  # only the a -> hole link is lossy
    assert plan.stats.refused == 1 and plan.stats.lost == 1


def test_delays_are_returned_and_too_slow_links_time_out() -> None:
    plan = FaultPlan(default=LinkFault(delay=0.02, jitter=0.01), seed=3)
    spent = asyncio.run(plan.apply("a", "b", 1.0))
    assert 0.02 <= spent <= 0.03
    plan.set_peer("slow", LinkFault(delay=0.2))
    with pytest.raises(DeadlineExceeded):
        asyncio.run(plan.apply("a", "slow", 0.05))


def test_loss_rate_is_about_right_and_seeded() -> None:
    def losses(seed: int) -> int:
        plan = FaultPlan(default=LinkFault(loss=0.3), seed=seed)

        async def go() -> int:
            lost = 0
            for _ in range(400):
                try:
                    await plan.apply("a", "b", 0.0)
                except DeadlineExceeded:
                    lost += 1
            return lost

        return asyncio.run(go())

    assert losses(1) == losses(1)
    assert 80 < losses(2) < 160


def test_link_fault_checks_its_values() -> None:
    with pytest.raises(ValueError):
        LinkFault(loss=1.5)
    with pytest.raises(ValueError):
        LinkFault(delay=-1)


def test_lose_first_loses_that_many_requests_per_link_then_heals() -> None:
    plan = FaultPlan()
    plan.set_peer("flaky", LinkFault(lose_first=2))

    async def outcomes(caller: str) -> list[bool]:
        results = []
        for _ in range(4):
            try:
                await plan.apply(caller, "flaky", 0.0)
                results.append(True)
            except DeadlineExceeded:
                results.append(False)
        return results

    assert asyncio.run(outcomes("a")) == [False, False, True, True]
    assert asyncio.run(outcomes("b")) == [False, False, True, True]  # counted per link
    assert plan.stats.lost == 4
    with pytest.raises(ValueError, match="lose_first"):
        LinkFault(lose_first=-1)
