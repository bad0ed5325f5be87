"""Tests of swarm.moe.server.runtime: batching, per-task results, faults, back-pressure, shutdown.

The compute thread is held inside a "gate" batch (a function blocked on a threading.Event)
whenever a test needs tasks to pile up; nothing here sleeps to wait for an event.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch

from swarm.core.errors import InvalidRequest, MoEError, ResourceExhausted
from swarm.moe.schema import TensorSchema
from swarm.moe.server.backend import ExpertBackend
from swarm.moe.server.runtime import Runtime
from swarm.moe.server.task_pool import TaskPool

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")
WAIT = 5.0


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(factory(), 20)

    return asyncio.run(bounded())


class Gate:
    """A batch function that blocks the compute thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        self.entered.set()
        if not self.release.wait(WAIT):
            raise TimeoutError("gate never released")
        return (x + 1,)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT), "gate batch never started"


class Recorder:
    """A batch function that records batch sizes and returns (10 * x, x.sum(dim=1))."""

    def __init__(self, fail: Callable[[torch.Tensor], Exception | None] | None = None) -> None:
        self.batches: list[int] = []
        self.fail = fail

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.batches.append(x.shape[0])
        if self.fail is not None and (error := self.fail(x)) is not None:
            raise error
        return x * 10, x.sum(dim=1)


@contextmanager
def running(*pools: TaskPool) -> Iterator[Runtime]:
    runtime = Runtime(pools)
    runtime.start()
    try:
        yield runtime
    finally:
        for pool in pools:
            if isinstance(pool.process_fn, Gate):
                pool.process_fn.release.set()
        runtime.shutdown(timeout=WAIT)
        assert not runtime.is_running


def rows(start: int, n: int, width: int = 3) -> torch.Tensor:
    return torch.arange(start * width, (start + n) * width, dtype=torch.float32).reshape(n, width)


async def let_tasks_enqueue() -> None:
    # submit() enqueues before its first suspension, so one pass of the loop is enough.
    await asyncio.sleep(0)


def test_concurrent_submitters_get_their_own_rows() -> None:
    recorder = Recorder()
    pool = TaskPool(recorder, "work", max_batch_size=64, max_wait=0.05)
    sizes = [1 + i % 5 for i in range(60)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    async def main() -> None:
        results = await asyncio.gather(*(pool.submit(rows(s, n)) for s, n in zip(starts, sizes)))
        for (s, n), (big, total) in zip(zip(starts, sizes), results):
            x = rows(s, n)
            assert torch.equal(big, x * 10)
            assert torch.equal(total, x.sum(dim=1))

    with running(pool):
        run(main)
    stats = pool.stats()
    assert stats.rows_processed == sum(sizes) == sum(recorder.batches)
    assert stats.batches_processed == len(recorder.batches) < len(sizes)  # tasks were merged
    assert max(recorder.batches) <= 64
    assert stats.queued_rows == stats.queued_tasks == 0


def test_batches_merge_and_respect_max_batch_size() -> None:
    gate, recorder = Gate(), Recorder()
    gate_pool = TaskPool(gate, "gate")
    pool = TaskPool(recorder, "work", max_batch_size=8)

    async def main() -> None:
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        tasks = [asyncio.create_task(pool.submit(rows(3 * i, 3))) for i in range(10)]
        await let_tasks_enqueue()
        assert pool.stats().queued_tasks == 10 and pool.stats().queued_rows == 30
        gate.release.set()
        results = await asyncio.gather(*tasks)
        for i, (big, _) in enumerate(results):
            assert torch.equal(big, rows(3 * i, 3) * 10)
        (out,) = await held
        assert torch.equal(out, torch.ones(1, 3))

    with running(gate_pool, pool):
        run(main)
    assert recorder.batches == [6, 6, 6, 6, 6]  # two 3-row tasks per batch of at most 8 rows
    assert pool.stats().batches_processed == 5


def test_exception_fails_every_task_of_the_batch_and_runtime_goes_on() -> None:
    gate = Gate()
    recorder = Recorder(fail=lambda x: ValueError("negative input") if (x < 0).any() else None)
    gate_pool, pool = TaskPool(gate, "gate"), TaskPool(recorder, "work")

    async def main() -> None:
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        bad = asyncio.create_task(pool.submit(-torch.ones(2, 3)))
        good = asyncio.create_task(pool.submit(torch.ones(2, 3)))
        await let_tasks_enqueue()
        gate.release.set()
        errors = await asyncio.gather(bad, good, return_exceptions=True)
        for error in errors:
            assert isinstance(error, MoEError)
            assert "task pool work: batch of 4 rows failed: ValueError: negative input" in str(error)
            assert isinstance(error.__cause__, ValueError)
        assert errors[0] is not errors[1]
        await held
        # the runtime keeps serving
        big, _ = await pool.submit(torch.ones(2, 3))
        assert torch.equal(big, torch.full((2, 3), 10.0))

    with running(gate_pool, pool):
        run(main)
    assert recorder.batches == [4, 2]
    stats = pool.stats()
    assert (stats.batches_failed, stats.batches_processed, stats.rows_processed) == (1, 1, 2)


def test_swarm_errors_pass_through_as_raised() -> None:
    def reject(x: torch.Tensor) -> tuple[torch.Tensor]:
        raise InvalidRequest("bad values", peer_id="me")

    pool = TaskPool(reject, "work")

    async def main() -> None:
        with pytest.raises(InvalidRequest, match="bad values") as info:
            await pool.submit(torch.ones(1, 2))
        assert info.value.peer_id == "me"

    with running(pool):
        run(main)


def test_malformed_outputs_fail_the_batch() -> None:
    pool = TaskPool(lambda x: x[:1], "work")

    async def main() -> None:
        with pytest.raises(MoEError, match="output 0 is \\(1, 2\\), expected a tensor with 3 rows"):
            await pool.submit(torch.ones(3, 2))

    with running(pool):
        run(main)


def test_incompatible_task_fails_alone() -> None:
    gate, recorder = Gate(), Recorder()
    gate_pool, pool = TaskPool(gate, "gate"), TaskPool(recorder, "work")

    async def main() -> None:
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        ok = asyncio.create_task(pool.submit(torch.ones(2, 3)))
        wrong_shape = asyncio.create_task(pool.submit(torch.ones(2, 4)))
        wrong_dtype = asyncio.create_task(pool.submit(torch.ones(2, 3, dtype=torch.float64)))
        await let_tasks_enqueue()
        gate.release.set()
        with pytest.raises(InvalidRequest, match="do not match the batch"):
            await wrong_shape
        with pytest.raises(InvalidRequest, match="do not match the batch"):
            await wrong_dtype
        big, _ = await ok
        assert torch.equal(big, torch.full((2, 3), 10.0))
        await held

    with running(gate_pool, pool):
        run(main)
    assert recorder.batches == [2]


def test_bad_tasks_are_refused_at_submission() -> None:
    pool = TaskPool(Recorder(), "work", max_batch_size=4)

    async def main() -> None:
        with pytest.raises(InvalidRequest, match="at least one tensor"):
            await pool.submit()
        with pytest.raises(InvalidRequest, match="not a tensor"):
            await pool.submit([1, 2])  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="disagree on the batch size"):
            await pool.submit(torch.ones(2, 3), torch.ones(3, 3))
        with pytest.raises(InvalidRequest, match="no rows"):
            await pool.submit(torch.ones(0, 3))
        with pytest.raises(InvalidRequest, match="no batch dimension"):
            await pool.submit(torch.tensor(1.0))
        with pytest.raises(ResourceExhausted, match="5 rows exceeds max_batch_size=4"):
            await pool.submit(torch.ones(5, 3))

    with running(pool):
        run(main)


def test_queue_full_is_refused_immediately() -> None:
    gate, recorder = Gate(), Recorder()
    gate_pool = TaskPool(gate, "gate")
    pool = TaskPool(recorder, "work", max_batch_size=4, max_queue_rows=5)

    async def main() -> None:
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        queued = [asyncio.create_task(pool.submit(torch.ones(n, 3))) for n in (2, 2)]
        await let_tasks_enqueue()
        with pytest.raises(ResourceExhausted, match="task pool work is full: 4 rows queued"):
            await pool.submit(torch.ones(2, 3))
        assert pool.stats().queued_rows == 4
        small = asyncio.create_task(pool.submit(torch.ones(1, 3)))  # still fits
        await let_tasks_enqueue()
        assert pool.stats().queued_rows == 5
        gate.release.set()
        await asyncio.gather(*queued, small, held)

    with running(gate_pool, pool):
        run(main)
    assert recorder.batches == [4, 1]


def test_cancelled_callers_do_not_disturb_the_batch() -> None:
    gate, recorder = Gate(), Recorder()
    gate_pool, pool = TaskPool(gate, "gate"), TaskPool(recorder, "work")

    async def main() -> None:
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        queued_then_cancelled = asyncio.create_task(pool.submit(torch.ones(5, 3)))
        kept = asyncio.create_task(pool.submit(torch.ones(2, 3)))
        await let_tasks_enqueue()
        assert pool.stats().queued_rows == 7
        queued_then_cancelled.cancel()
        held.cancel()  # cancelled while its batch is running
        with pytest.raises(asyncio.CancelledError):
            await queued_then_cancelled
        with pytest.raises(asyncio.CancelledError):
            await held
        assert pool.stats().queued_rows == 2
        gate.release.set()
        big, _ = await kept
        assert torch.equal(big, torch.full((2, 3), 10.0))
        (out,) = await gate_pool.submit(torch.zeros(1, 3))  # the gate pool still works
        assert torch.equal(out, torch.ones(1, 3))

    with running(gate_pool, pool):
        run(main)
    assert recorder.batches == [2]
    assert gate_pool.stats().batches_processed == 2


def test_event_loop_stays_responsive_during_slow_batch() -> None:
    gate = Gate()
    pool = TaskPool(gate, "gate")

    async def main() -> None:
        slow = asyncio.create_task(pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        ticks = 0
        for _ in range(20):  # a timer keeps ticking while the compute thread is busy
            await asyncio.sleep(0.001)
            ticks += 1
        assert ticks == 20 and not slow.done()
        gate.release.set()
        await slow

    with running(pool):
        run(main)


def test_shutdown_fails_queued_tasks_and_lets_the_running_batch_finish() -> None:
    gate, recorder = Gate(), Recorder()
    gate_pool, pool = TaskPool(gate, "gate"), TaskPool(recorder, "work")
    runtime = Runtime([gate_pool, pool])

    async def main() -> None:
        with pytest.raises(MoEError, match="not accepting tasks: its runtime has not started"):
            await pool.submit(torch.ones(1, 3))
        runtime.start()
        held = asyncio.create_task(gate_pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        queued = asyncio.create_task(pool.submit(torch.ones(2, 3)))
        await let_tasks_enqueue()
        stopping = asyncio.create_task(asyncio.to_thread(runtime.shutdown, WAIT))
        with pytest.raises(MoEError, match="task pool work: the runtime is shut down before the task ran"):
            await queued
        gate.release.set()
        (out,) = await held  # the running batch still delivers
        assert torch.equal(out, torch.ones(1, 3))
        await stopping
        assert not runtime.is_running
        with pytest.raises(MoEError, match="not accepting tasks: the runtime is shut down"):
            await pool.submit(torch.ones(1, 3))
        runtime.shutdown()  # idempotent

    try:
        run(main)
    finally:
        gate.release.set()
        runtime.shutdown()
    assert recorder.batches == []
    with pytest.raises(RuntimeError, match="already started"):
        runtime.start()


def test_shutdown_fails_a_stuck_batch_after_its_timeout() -> None:
    gate = Gate()
    pool = TaskPool(gate, "gate")
    runtime = Runtime([pool])
    runtime.start()

    async def main() -> None:
        stuck = asyncio.create_task(pool.submit(torch.zeros(1, 3)))
        await gate.wait_entered()
        await asyncio.to_thread(runtime.shutdown, 0.01)
        with pytest.raises(MoEError, match="shut down while the task was running"):
            await stuck

    try:
        run(main)
    finally:
        gate.release.set()
        runtime.shutdown()


def test_min_batch_size_waits_but_never_starves() -> None:
    recorder = Recorder()
    pool = TaskPool(
        recorder, "work", min_batch_size=4, max_batch_size=8, max_wait=0.0, min_batch_timeout=0.01
    )

    async def main() -> None:
        big, _ = await pool.submit(torch.ones(1, 3))  # alone, below min_batch_size
        assert torch.equal(big, torch.full((1, 3), 10.0))

    with running(pool):
        run(main)
    assert recorder.batches == [1]


def test_runtime_serves_expert_backend() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    schema = (TensorSchema((4,), torch.float32),)
    backend = ExpertBackend(
        "ffn.0.0",
        module,
        torch.optim.SGD(module.parameters(), lr=0.0),
        args_schema=schema,
        outputs_schema=schema,
        max_batch_size=32,
    )
    forward = TaskPool(backend.forward, "ffn.0.0.forward", max_batch_size=32, max_wait=0.01)
    backward = TaskPool(backend.backward, "ffn.0.0.backward", max_batch_size=32, max_wait=0.01)
    inputs = [torch.randn(n, 4) for n in (1, 3, 5, 7)]

    async def main() -> None:
        outputs = await asyncio.gather(*(forward.submit(x) for x in inputs))
        for x, (y,) in zip(inputs, outputs):
            assert torch.allclose(y, module(x).detach(), atol=1e-6)
        grads = await asyncio.gather(*(backward.submit(x, torch.ones_like(x)) for x in inputs))
        for x, (gx,) in zip(inputs, grads):
            assert torch.allclose(gx, torch.ones_like(x) @ module.weight.detach(), atol=1e-6)

    with running(forward, backward):
        run(main)


def test_construction_validates() -> None:
    fn = Recorder()
    with pytest.raises(ValueError, match="max_batch_size"):
        TaskPool(fn, "p", max_batch_size=0)
    with pytest.raises(ValueError, match="min_batch_size"):
        TaskPool(fn, "p", min_batch_size=5, max_batch_size=4)
    with pytest.raises(ValueError, match="max_queue_rows"):
        TaskPool(fn, "p", max_batch_size=4, max_queue_rows=3)
    with pytest.raises(ValueError, match="max_wait"):
        TaskPool(fn, "p", max_wait=-1)
    with pytest.raises(TypeError):
        TaskPool("nope", "p")  # type: ignore[arg-type]
    assert TaskPool(fn, "p", max_batch_size=4).max_queue_rows == 64
    with pytest.raises(ValueError, match="unique"):
        Runtime([TaskPool(fn, "p"), TaskPool(fn, "p")])
    with pytest.raises(ValueError, match="at least one pool"):
        Runtime([])
    pool = TaskPool(fn, "p")
    Runtime([pool])
    with pytest.raises(ValueError, match="already belongs"):
        Runtime([pool])
