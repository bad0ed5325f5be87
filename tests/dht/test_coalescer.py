"""Tests for swarm.dht.coalescer (no sockets): bursts become batches, answers come back one by one."""

from __future__ import annotations

import asyncio

import pytest

from swarm.dht.coalescer import Coalescer


def test_a_burst_runs_as_one_batch_and_each_answer_arrives_when_ready() -> None:
    batches: list[list[int]] = []
    release = asyncio.Event()

    async def run(items, deliver):
        batches.append(items)
        for index, item in enumerate(items):
            if item != 3:
                deliver(index, item * 10)
        await release.wait()  # the slow item holds the batch, not the others
        deliver(items.index(3), 30)

    async def go() -> None:
        coalescer = Coalescer(run, "test")
        futures = [coalescer.submit(i) for i in range(5)]
        ready = await asyncio.wait_for(asyncio.gather(*(futures[i] for i in (0, 1, 2, 4))), timeout=1)
        assert ready == [0, 10, 20, 40] and not futures[3].done()
        release.set()
        assert await futures[3] == 30
        assert batches == [[0, 1, 2, 3, 4]]
        later = coalescer.submit(7)  # a new burst, a new batch
        release.set()
        assert await later == 70 and batches[-1] == [7]

    asyncio.run(go())


def test_a_failing_batch_fails_the_requests_it_did_not_answer() -> None:
    async def run(items, deliver):
        deliver(0, "ok")
        raise ValueError("boom")

    async def go() -> None:
        coalescer = Coalescer(run, "test")
        first, second = coalescer.submit(1), coalescer.submit(2)
        assert await first == "ok"
        with pytest.raises(ValueError, match="boom"):
            await second

    asyncio.run(go())


def test_close_cancels_batches_in_flight() -> None:
    started = asyncio.Event()

    async def run(items, deliver):
        started.set()
        await asyncio.Event().wait()  # never answers

    async def go() -> None:
        coalescer = Coalescer(run, "test")
        future = coalescer.submit(1)
        await asyncio.wait_for(started.wait(), timeout=1)
        await coalescer.close()
        assert future.cancelled()

    asyncio.run(go())
