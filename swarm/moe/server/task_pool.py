"""Task pools: queues of tasks for one batch function, merged into batches by a `Runtime`.

A `TaskPool` wraps one function (say, one expert's forward). Callers on an asyncio event loop
``await pool.submit(*tensors)``; the pool queues the task and returns control to the loop at
once. The `swarm.moe.server.runtime.Runtime` that owns the pool takes the tasks at its head,
concatenates them along dim 0 into one batch, runs the pool's function on a compute thread,
splits the outputs back by rows, and hands each caller its own slice through
``loop.call_soon_threadsafe``.

When a pool is ready (all times from the first queued task's arrival):

- at once, when it holds at least ``max_batch_size`` rows (or ``max_batch_tasks`` tasks);
- after ``max_wait`` seconds, when it holds at least ``min_batch_size`` rows;
- after ``min_batch_timeout`` seconds in any case, so a lone small task never starves.

A batch never exceeds ``max_batch_size`` rows: a task larger than that is refused at
submission (`ResourceExhausted`), since the function it would reach (an expert with the same
limit) could not run it anyway. ``max_batch_tasks=1`` turns merging off (one task per call).

A task may carry a ``tag`` (any object, e.g. who asked and why). A pool built with
``pass_tags=True`` calls its function as ``fn(*batch_tensors, tags=[tag of each task])``, so
the function can treat a batch differently by who is in it (an expert keeps the autograd
graph of a forward that ran alone, for the backward that will follow).

Running a batch, and how its faults reach the callers: `swarm.moe.server.batch_runner`. A caller
that is cancelled while waiting is removed from the queue, or, if its batch is already running,
its result is dropped; neither disturbs the other tasks.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from swarm.core.errors import InvalidRequest, MoEError, ResourceExhausted
from swarm.moe.server.batch_runner import BatchRunner, ProcessFn, Task

__all__ = ["PoolStats", "TaskPool"]


@dataclass(frozen=True)
class PoolStats:
    """Counters of one pool, for metrics.

    Attributes:
        name: the pool's name.
        batches_processed: batches whose function returned successfully.
        rows_processed: rows in those batches.
        batches_failed: batches whose function raised (or returned malformed outputs).
        queued_tasks: tasks waiting now.
        queued_rows: rows waiting now.
    """

    name: str
    batches_processed: int
    rows_processed: int
    batches_failed: int
    queued_tasks: int
    queued_rows: int


class TaskPool(BatchRunner):
    """A queue of tasks for one batch function, served by a `Runtime`.

    Args:
        process_fn: the batch function, e.g. ``backend.forward``; it runs only on the
            runtime's compute threads, one batch of the pool's group at a time.
        name: names the pool in stats, logs and error messages (unique within a runtime).
        min_batch_size: after ``max_wait``, run only batches with at least this many rows,
            unless the first task has waited ``min_batch_timeout``.
        max_batch_size: the most rows in one batch; larger tasks are refused.
        max_wait: seconds to wait for more tasks after the first one arrives.
        max_queue_rows: the most rows waiting at once; a submission beyond it is refused with
            `ResourceExhausted`. Defaults to ``16 * max_batch_size``.
        min_batch_timeout: the longest a task waits for the batch to reach ``min_batch_size``.
        max_batch_tasks: the most tasks merged into one batch; ``1`` disables batching,
            ``None`` (default) means no limit beyond ``max_batch_size``.
        pass_tags: call ``process_fn(*tensors, tags=[...])`` with each task's tag, in batch order.
        group: pools sharing a group never run batches at the same time, even on a runtime with
            several workers (e.g. one expert's forward and backward pools, which share its
            parameters). None: the pool is a group of its own (its batches never overlap).

    Raises:
        ValueError: an argument is invalid.
    """

    def __init__(
        self,
        process_fn: ProcessFn,
        name: str,
        min_batch_size: int = 1,
        max_batch_size: int = 4096,
        max_wait: float = 0.002,
        max_queue_rows: int | None = None,
        min_batch_timeout: float = 0.1,
        *,
        max_batch_tasks: int | None = None,
        pass_tags: bool = False,
        group: Hashable | None = None,
    ) -> None:
        if not callable(process_fn):
            raise TypeError("process_fn must be callable")
        if not isinstance(name, str) or not name:
            raise ValueError(f"pool name must be a non-empty str, got {name!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not isinstance(min_batch_size, int) or not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(
                f"min_batch_size must be an int in [1, max_batch_size={max_batch_size}], got {min_batch_size!r}"
            )
        if not max_wait >= 0:
            raise ValueError(f"max_wait must be >= 0, got {max_wait!r}")
        if not min_batch_timeout >= max_wait:
            raise ValueError(f"min_batch_timeout must be >= max_wait, got {min_batch_timeout!r}")
        if max_queue_rows is None:
            max_queue_rows = 16 * max_batch_size
        if not isinstance(max_queue_rows, int) or max_queue_rows < max_batch_size:
            raise ValueError(
                f"max_queue_rows must be an int >= max_batch_size={max_batch_size}, got {max_queue_rows!r}"
            )
        if max_batch_tasks is not None and (not isinstance(max_batch_tasks, int) or max_batch_tasks < 1):
            raise ValueError(f"max_batch_tasks must be a positive int or None, got {max_batch_tasks!r}")
        self.process_fn = process_fn
        self.name = name
        self.max_batch_tasks = max_batch_tasks
        self.pass_tags = pass_tags
        self.group: Hashable = self if group is None else group
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.max_wait = float(max_wait)
        self.max_queue_rows = max_queue_rows
        self.min_batch_timeout = float(min_batch_timeout)
        # Guarded by _cond, which the owning Runtime replaces with its own shared condition.
        self._cond = threading.Condition()
        self._accepting = False
        self._closed_reason = "its runtime has not started"
        self._queue: deque[Task] = deque()
        self.runtime: object | None = None
        """The `Runtime` serving this pool (set by it; a pool belongs to one runtime at a time)."""
        self._queued_rows = 0
        self._batches_processed = 0
        self._rows_processed = 0
        self._batches_failed = 0

    # ---- caller side (any event loop) ---------------------------------------------------------

    async def submit(self, *tensors: torch.Tensor, tag: Hashable | None = None) -> tuple[torch.Tensor, ...]:
        """Queues one task and waits for its slice of the batch outputs.

        Never blocks the event loop: the compute runs on the runtime's thread.

        Args:
            *tensors: the task's tensors, sharing a leading batch dim of at least 1 row.
            tag: passed to the function with the batch when the pool has ``pass_tags``.

        Returns:
            The function's outputs for exactly this task's rows.

        Raises:
            InvalidRequest: no tensors, a non-tensor, or mismatched/empty batch dims; or the
                task cannot be batched with the others (mismatched shapes or dtypes).
            ResourceExhausted: the task is larger than ``max_batch_size`` or the queue is full.
            MoEError: the runtime is not running or shut down before the task ran, or the
                function failed (a `SwarmError` it raised is passed on as is).
        """
        return await self._wait(self._enqueue(tensors, tag))

    def _enqueue(self, tensors: tuple[torch.Tensor, ...], tag: Hashable | None, enqueued_at: float | None = None) -> Task:
        """Checks and queues one task (on the caller's loop, which `_wait` must then await on).

        `enqueued_at` (monotonic; default now) lets tasks queued together share one arrival time,
        so their pools become ready at the same instant."""
        rows = self._check_task(tensors)
        loop = asyncio.get_running_loop()
        task = Task(tuple(tensors), rows, loop.create_future(), loop, tag)
        if enqueued_at is not None:
            task.enqueued_at = enqueued_at
        with self._cond:
            if not self._accepting:
                raise MoEError(f"task pool {self.name} is not accepting tasks: {self._closed_reason}")
            if self._queued_rows + rows > self.max_queue_rows:
                raise ResourceExhausted(
                    f"task pool {self.name} is full: {self._queued_rows} rows queued, a task of "
                    f"{rows} rows would exceed the limit of {self.max_queue_rows}; retry later"
                )
            self._queue.append(task)
            self._queued_rows += rows
            self._cond.notify_all()
        return task

    async def _wait(self, task: Task) -> tuple[torch.Tensor, ...]:
        try:
            return await task.future
        except asyncio.CancelledError:
            self._discard(task)
            raise

    def _check_task(self, tensors: Sequence[object]) -> int:
        if not tensors:
            raise InvalidRequest(f"task pool {self.name}: a task needs at least one tensor")
        rows = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise InvalidRequest(
                    f"task pool {self.name}: argument {i} is {type(t).__name__}, not a tensor"
                )
            if t.dim() < 1:
                raise InvalidRequest(f"task pool {self.name}: argument {i} has no batch dimension")
            rows.add(t.shape[0])
        if len(rows) != 1:
            raise InvalidRequest(f"task pool {self.name}: tensors disagree on the batch size: {sorted(rows)}")
        (n,) = rows
        if n < 1:
            raise InvalidRequest(f"task pool {self.name}: the task has no rows")
        if n > self.max_batch_size:
            raise ResourceExhausted(
                f"task pool {self.name}: a task of {n} rows exceeds max_batch_size={self.max_batch_size}; "
                f"split it"
            )
        return n

    def _discard(self, task: Task) -> None:
        with self._cond:
            try:
                self._queue.remove(task)
            except ValueError:  # already taken into a batch: its result will be dropped
                return
            self._queued_rows -= task.rows

    def wait_queued(self, tasks: int, timeout: float | None = None) -> bool:
        """Blocks until at least `tasks` tasks wait in the queue; False on timeout (for tests, tools)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._queue) >= tasks, timeout)

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """Returns a consistent snapshot of this pool's counters."""
        with self._cond:
            return PoolStats(
                name=self.name,
                batches_processed=self._batches_processed,
                rows_processed=self._rows_processed,
                batches_failed=self._batches_failed,
                queued_tasks=len(self._queue),
                queued_rows=self._queued_rows,
            )

    # ---- runtime side (lock held unless noted) --------------------------------------------------

    def _ready_at(self) -> float | None:
        """When the head batch becomes ready (monotonic time), or None if the queue is empty."""
        if not self._queue:
            return None
        first = self._queue[0].enqueued_at
        if self._queued_rows >= self.max_batch_size:
            return first
        if self.max_batch_tasks is not None and len(self._queue) >= self.max_batch_tasks:
            return first
        if self._queued_rows >= self.min_batch_size:
            return first + self.max_wait
        return first + self.min_batch_timeout

    def _take_batch(self) -> list[Task]:
        batch: list[Task] = []
        rows = 0
        limit = self.max_batch_tasks or len(self._queue)
        while self._queue and len(batch) < limit and rows + self._queue[0].rows <= self.max_batch_size:
            task = self._queue.popleft()
            batch.append(task)
            rows += task.rows
        self._queued_rows -= rows
        return batch

    def _drain(self, reason: str) -> list[Task]:
        self._accepting = False
        self._closed_reason = reason
        tasks = list(self._queue)
        self._queue.clear()
        self._queued_rows = 0
        return tasks

    def __repr__(self) -> str:
        return f"TaskPool({self.name!r}, max_batch_size={self.max_batch_size})"
