"""Tests of what swarm.moe.server.task_pool adds beyond test_runtime.py: tags, max_batch_tasks, wait_queued."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from swarm.moe.server.runtime import Runtime
from swarm.moe.server.task_pool import TaskPool

pytestmark = pytest.mark.timeout(30)


def test_tags_reach_the_function_in_batch_order_and_max_batch_tasks_caps_merging() -> None:
    release = threading.Event()
    seen: list[list[object]] = []

    def fn(x: torch.Tensor, *, tags: list[object]) -> tuple[torch.Tensor]:
        release.wait(10)
        seen.append(tags)
        return (x + 1,)

    pool = TaskPool(fn, "tagged", max_batch_tasks=2, pass_tags=True)
    with Runtime([pool]):

        async def main() -> list[tuple[torch.Tensor, ...]]:
            tasks = [asyncio.ensure_future(pool.submit(torch.full((1, 2), float(i)), tag=f"t{i}")) for i in range(5)]
            await asyncio.sleep(0)  # submit() enqueues before its first suspension
            assert await asyncio.to_thread(pool.wait_queued, 3, 5)  # the first batch holds the thread
            release.set()
            return await asyncio.gather(*tasks)

        results = asyncio.run(main())
    assert [float(r[0][0, 0]) for r in results] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [len(tags) for tags in seen] in ([1, 2, 2], [2, 2, 1])
    assert [t for tags in seen for t in tags] == ["t0", "t1", "t2", "t3", "t4"]


def test_bad_max_batch_tasks_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_tasks"):
        TaskPool(lambda x: x, "p", max_batch_tasks=0)
