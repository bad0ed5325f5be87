"""Tests of a swarm.moe.server.runtime.Runtime with several compute workers: groups, thread budget, submit_together.

Batch functions block on threading events (or a barrier) to hold workers; nothing here sleeps to
wait for an event.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from swarm.core.errors import MoEError, ResourceExhausted
from swarm.moe.server.runtime import Runtime
from swarm.moe.server.task_pool import TaskPool

pytestmark = pytest.mark.timeout(30)
WAIT = 5.0


def run(coro_factory):
    async def bounded():
        return await asyncio.wait_for(coro_factory(), 20)

    return asyncio.run(bounded())


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class Blocker:
    """A batch function that records when it runs and blocks until released."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        self.log.append(f"{self.name} start")
        self.entered.set()
        if not self.release.wait(WAIT):
            raise TimeoutError("never released")
        self.log.append(f"{self.name} end")
        return (x + 1,)


def recording(name: str, log: list[str]):
    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        log.append(name)
        return (x * 2,)

    return fn


@contextmanager
def running(*pools: TaskPool, threads: int = 2, workers: int = 2) -> Iterator[Runtime]:
    runtime = Runtime(pools, threads=threads, workers=workers)
    runtime.start()
    try:
        yield runtime
    finally:
        for pool in pools:
            if isinstance(pool.process_fn, Blocker):
                pool.process_fn.release.set()
        runtime.shutdown(timeout=WAIT)
        assert not runtime.is_running


def test_batches_of_different_groups_run_side_by_side() -> None:
    log: list[str] = []
    blocker = Blocker("a", log)
    a, b = TaskPool(blocker, "a"), TaskPool(recording("b", log), "b")

    async def main() -> None:
        held, quick = runtime.submit_together([(a, [torch.zeros(1, 2)], None), (b, [torch.ones(1, 2)], None)])
        (out,) = await quick  # answered while the other worker is held in a
        assert torch.equal(out, torch.full((1, 2), 2.0))
        assert "a end" not in log and "b" in log
        blocker.release.set()
        await held

    with running(a, b) as runtime:
        run(main)


def test_pools_of_one_group_never_overlap() -> None:
    log: list[str] = []
    blocker = Blocker("forward", log)
    forward = TaskPool(blocker, "e.forward", group="e")
    backward = TaskPool(recording("backward", log), "e.backward", group="e")
    other = TaskPool(recording("other", log), "other")

    async def main() -> None:
        # queued together, so the budget of two threads is split: the other worker stays free
        held, first = runtime.submit_together([(forward, [torch.zeros(1, 2)], None), (other, [torch.zeros(1, 2)], None)])
        await first
        assert await asyncio.to_thread(blocker.entered.wait, WAIT)
        waiting = asyncio.create_task(backward.submit(torch.zeros(1, 2)))
        await asyncio.sleep(0)  # queued before the next `other`: the free worker would take it first if it could
        await other.submit(torch.zeros(1, 2))
        assert log[-1] == "other" and "backward" not in log and not waiting.done()
        blocker.release.set()
        await asyncio.gather(held, waiting)
        assert log.index("forward end") < log.index("backward")

    with running(forward, backward, other) as runtime:
        run(main)


def test_the_thread_budget_is_split_among_concurrent_batches() -> None:
    both = threading.Barrier(2, timeout=WAIT)
    seen: dict[str, int] = {}

    def meeting(name: str):
        def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
            seen[name] = torch.get_num_threads()
            both.wait()  # breaks (and fails the batch) unless the two batches run at the same time
            return (x,)

        return fn

    def alone(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen["alone" if "alone" not in seen else "alone again"] = torch.get_num_threads()
        return (x,)

    a, b, c = TaskPool(meeting("a"), "a"), TaskPool(meeting("b"), "b"), TaskPool(alone, "c")

    async def main() -> None:
        await c.submit(torch.zeros(1, 2))
        futures = runtime.submit_together([(a, [torch.zeros(1, 2)], None), (b, [torch.zeros(2, 2)], None)])
        outputs = await asyncio.gather(*futures)
        assert [o[0].shape[0] for o in outputs] == [1, 2]
        await c.submit(torch.zeros(1, 2))

    with running(a, b, c) as runtime:
        run(main)
    assert seen == {"alone": 2, "a": 1, "b": 1, "alone again": 2}


def test_tasks_queued_together_become_ready_at_the_same_instant() -> None:
    # With arrival times microseconds apart, a worker waking at the first pool's batching deadline
    # could see it ready alone, take the whole thread budget, and leave the others queued behind it.
    log: list[str] = []
    blocker = Blocker("held", log)
    held_pool = TaskPool(blocker, "held")
    a, b = TaskPool(recording("a", log), "a"), TaskPool(recording("b", log), "b", max_wait=0.002)

    async def main() -> None:
        held = asyncio.ensure_future(held_pool.submit(torch.zeros(1, 2)))
        assert await asyncio.to_thread(blocker.entered.wait, WAIT)  # the only worker is busy: a and b stay queued
        futures = runtime.submit_together([(a, [torch.zeros(1, 2)], None), (b, [torch.zeros(1, 2)], None)])
        assert a._ready_at() == b._ready_at()
        blocker.release.set()
        await asyncio.gather(held, *futures)

    with running(held_pool, a, b, workers=1) as runtime:
        run(main)


def test_submit_together_refuses_per_request() -> None:
    log: list[str] = []
    small = TaskPool(recording("small", log), "small", max_batch_size=2)
    big = TaskPool(recording("big", log), "big")
    stranger = TaskPool(recording("stranger", log), "stranger")

    async def main() -> None:
        refused, ok = runtime.submit_together([(small, [torch.zeros(3, 2)], None), (big, [torch.ones(3, 2)], None)])
        with pytest.raises(ResourceExhausted, match="exceeds max_batch_size=2"):
            await refused
        (out,) = await ok
        assert torch.equal(out, torch.full((3, 2), 2.0))
        with pytest.raises(ValueError, match="does not belong to this runtime"):
            runtime.submit_together([(stranger, [torch.zeros(1, 2)], None)])

    with running(small, big) as runtime:
        run(main)
    assert log == ["big"]


def test_shutdown_fails_batches_stuck_on_every_worker() -> None:
    log: list[str] = []
    first, second = Blocker("first", log), Blocker("second", log)
    a, b = TaskPool(first, "a"), TaskPool(second, "b")
    runtime = Runtime([a, b], threads=2, workers=2)
    runtime.start()

    async def main() -> None:
        # queued together, so each worker takes one with half the thread budget (queued one after
        # the other, the first to be ready could take both threads and hold the second back)
        stuck = runtime.submit_together([(a, [torch.zeros(1, 2)], None), (b, [torch.zeros(1, 2)], None)])
        assert await asyncio.to_thread(first.entered.wait, WAIT)
        assert await asyncio.to_thread(second.entered.wait, WAIT)
        await asyncio.to_thread(runtime.shutdown, 0.01)
        for task in stuck:
            with pytest.raises(MoEError, match="shut down while the task was running"):
                await task

    try:
        run(main)
    finally:
        first.release.set()
        second.release.set()
        runtime.shutdown()


def test_construction_validates_workers() -> None:
    with pytest.raises(ValueError, match="workers must be a positive int"):
        Runtime([TaskPool(recording("p", []), "p")], workers=0)
