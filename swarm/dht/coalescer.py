"""Coalescing of concurrent single requests into batches (used by `DHT` for stores and gets).

Requests submitted in the same event-loop iteration are run as one batch on the next iteration,
so a burst of single gets costs one batched lookup; each request is answered as soon as its own
item is settled, so one slow key does not hold back the rest of its batch. A lone request waits
for no timer: it starts on the very next loop iteration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from swarm.core.loop import spawn

T = TypeVar("T")
R = TypeVar("R")
logger = logging.getLogger(__name__)


class Coalescer(Generic[T, R]):
    """Gathers requests made in one loop iteration into one batch; answers each as it settles.

    Args:
        run: `run(items, deliver)` handles a batch, calling `deliver(index, result)` for each item.
        name: Name of the batch tasks (for logs).
    """

    def __init__(self, run: Callable[[list[T], Callable[[int, R], None]], Awaitable[object]], name: str) -> None:
        self._run = run
        self._name = name
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._tasks: set[asyncio.Task[object]] = set()

    def submit(self, item: T) -> asyncio.Future[R]:
        """Queues `item` for the next batch; the future gets its result (call from the loop)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((item, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = spawn(self._run_batch(batch), name=self._name)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        futures = [future for _, future in batch]

        def deliver(index: int, result: R) -> None:
            if not futures[index].done():
                futures[index].set_result(result)

        try:
            await self._run([item for item, _ in batch], deliver)
        except BaseException as e:
            unanswered = [future for future in futures if not future.done()]
            for future in unanswered:
                if isinstance(e, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            if not unanswered:
                logger.warning("%s failed after answering every request", self._name, exc_info=e)
        for future in futures:
            if not future.done():  # the batch ended without settling it (cannot happen; be safe)
                future.set_exception(RuntimeError("DHT batch ended without an answer"))

    async def close(self) -> None:
        """Cancels the batches in flight (their callers see `CancelledError`)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
