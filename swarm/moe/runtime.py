"""The batching runtime: merges small tasks from many callers into batches for one compute thread.

A `TaskPool` wraps one function (say, one expert's forward). Callers on an asyncio event loop
``await pool.submit(*tensors)``; the pool queues the task and returns control to the loop at
once. One `Runtime` owns one dedicated compute thread that serves several pools: it takes the
tasks at the head of a ready pool, concatenates them along dim 0 into one batch, runs the
pool's function, splits the outputs back by rows, and hands each caller its own slice through
``loop.call_soon_threadsafe``. Only that thread ever runs pool functions, so an
`swarm.moe.backend.ExpertBackend` needs no locking of its own.

When a pool is ready (all times from the first queued task's arrival):

- at once, when it holds at least ``max_batch_size`` rows;
- after ``max_wait`` seconds, when it holds at least ``min_batch_size`` rows;
- after ``min_batch_timeout`` seconds in any case, so a lone small task never starves.

Among ready pools the one whose head task is oldest goes first. A batch never exceeds
``max_batch_size`` rows: a task larger than that is refused at submission
(`ResourceExhausted`), since the function it would reach (an expert with the same limit)
could not run it anyway.

Faults are per batch and per task: a task whose tensors cannot be concatenated with the
batch's first task fails alone (`InvalidRequest`); if the function raises, every task of that
batch fails with the error (a `SwarmError` as raised, anything else wrapped in `MoEError`) and
the runtime goes on with the next batch. A caller that is cancelled while waiting is removed
from the queue, or, if its batch is already running, its result is dropped; neither disturbs
the other tasks.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from swarm.core.errors import InvalidRequest, MoEError, ResourceExhausted, SwarmError

__all__ = ["PoolStats", "ProcessFn", "Runtime", "TaskPool"]

logger = logging.getLogger(__name__)

ProcessFn = Callable[..., "Sequence[torch.Tensor] | torch.Tensor"]
"""A batch function: takes tensors sharing a leading batch dim, returns tensors with the same."""


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


@dataclass(eq=False)
class _Task:
    args: tuple[torch.Tensor, ...]
    rows: int
    future: asyncio.Future[tuple[torch.Tensor, ...]]
    loop: asyncio.AbstractEventLoop
    enqueued_at: float = field(default_factory=time.monotonic)


def _resolve(
    future: asyncio.Future[tuple[torch.Tensor, ...]],
    result: tuple[torch.Tensor, ...] | None,
    error: BaseException | None,
) -> None:
    # Runs on the caller's loop; the caller may have been cancelled meanwhile.
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _deliver(task: _Task, result: tuple[torch.Tensor, ...] | None, error: BaseException | None) -> None:
    try:
        task.loop.call_soon_threadsafe(_resolve, task.future, result, error)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


def _per_task_error(error: BaseException) -> BaseException:
    # One exception object per caller, so tracebacks of different callers do not pile up.
    try:
        clone = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied is shared instead
        return error
    clone.__cause__ = error.__cause__
    return clone


class TaskPool:
    """A queue of tasks for one batch function, served by a `Runtime`.

    Args:
        process_fn: the batch function, e.g. ``backend.forward``; it runs only on the
            runtime's compute thread.
        name: names the pool in stats, logs and error messages (unique within a runtime).
        min_batch_size: after ``max_wait``, run only batches with at least this many rows,
            unless the first task has waited ``min_batch_timeout``.
        max_batch_size: the most rows in one batch; larger tasks are refused.
        max_wait: seconds to wait for more tasks after the first one arrives.
        max_queue_rows: the most rows waiting at once; a submission beyond it is refused with
            `ResourceExhausted`. Defaults to ``16 * max_batch_size``.
        min_batch_timeout: the longest a task waits for the batch to reach ``min_batch_size``.

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
        self.process_fn = process_fn
        self.name = name
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.max_wait = float(max_wait)
        self.max_queue_rows = max_queue_rows
        self.min_batch_timeout = float(min_batch_timeout)
        # Guarded by _cond, which the owning Runtime replaces with its own shared condition.
        self._cond = threading.Condition()
        self._runtime: Runtime | None = None
        self._accepting = False
        self._closed_reason = "its runtime has not started"
        self._queue: deque[_Task] = deque()
        self._queued_rows = 0
        self._batches_processed = 0
        self._rows_processed = 0
        self._batches_failed = 0

    # ---- caller side (any event loop) ---------------------------------------------------------

    async def submit(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queues one task and waits for its slice of the batch outputs.

        Never blocks the event loop: the compute runs on the runtime's thread.

        Args:
            *tensors: the task's tensors, sharing a leading batch dim of at least 1 row.

        Returns:
            The function's outputs for exactly this task's rows.

        Raises:
            InvalidRequest: no tensors, a non-tensor, or mismatched/empty batch dims; or the
                task cannot be batched with the others (mismatched shapes or dtypes).
            ResourceExhausted: the task is larger than ``max_batch_size`` or the queue is full.
            MoEError: the runtime is not running or shut down before the task ran, or the
                function failed (a `SwarmError` it raised is passed on as is).
        """
        rows = self._check_task(tensors)
        loop = asyncio.get_running_loop()
        task = _Task(tuple(tensors), rows, loop.create_future(), loop)
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
        try:
            return await task.future
        except asyncio.CancelledError:
            self._discard(task)
            raise

    def _check_task(self, tensors: tuple[Any, ...]) -> int:
        if not tensors:
            raise InvalidRequest(f"task pool {self.name}: a task needs at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise InvalidRequest(
                    f"task pool {self.name}: argument {i} is {type(t).__name__}, not a tensor"
                )
            if t.dim() < 1:
                raise InvalidRequest(f"task pool {self.name}: argument {i} has no batch dimension")
        rows = {t.shape[0] for t in tensors}
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

    def _discard(self, task: _Task) -> None:
        with self._cond:
            try:
                self._queue.remove(task)
            except ValueError:  # already taken into a batch: its result will be dropped
                return
            self._queued_rows -= task.rows

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
        if self._queued_rows >= self.min_batch_size:
            return first + self.max_wait
        return first + self.min_batch_timeout

    def _take_batch(self) -> list[_Task]:
        batch: list[_Task] = []
        rows = 0
        while self._queue and rows + self._queue[0].rows <= self.max_batch_size:
            task = self._queue.popleft()
            batch.append(task)
            rows += task.rows
        self._queued_rows -= rows
        return batch

    def _drain(self, reason: str) -> list[_Task]:
        self._accepting = False
        self._closed_reason = reason
        tasks = list(self._queue)
        self._queue.clear()
        self._queued_rows = 0
        return tasks

    def _run_batch(self, tasks: list[_Task]) -> None:
        """Runs one batch and delivers the results. Called on the compute thread, lock NOT held."""
        tasks = self._drop_incompatible(tasks)
        if not tasks:
            return
        rows = [t.rows for t in tasks]
        total = sum(rows)
        try:
            if len(tasks) == 1:
                inputs = tasks[0].args
            else:
                inputs = tuple(torch.cat(column, dim=0) for column in zip(*(t.args for t in tasks)))
            outputs = self.process_fn(*inputs)
            outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
            for i, out in enumerate(outputs):
                if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != total:
                    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise MoEError(
                        f"task pool {self.name}: output {i} is {shape}, expected a tensor with {total} rows"
                    )
            slices = [torch.split(out, rows, dim=0) for out in outputs]
        except BaseException as e:  # every failure goes to the batch's callers first
            if isinstance(e, SwarmError):
                logger.debug("task pool %s: batch of %d rows failed: %s", self.name, total, e)
                error: BaseException = e
            else:
                logger.exception("task pool %s: batch of %d rows failed", self.name, total)
                error = MoEError(
                    f"task pool {self.name}: batch of {total} rows failed: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
            with self._cond:
                self._batches_failed += 1
            for task in tasks:
                _deliver(task, None, _per_task_error(error))
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt / SystemExit: the thread stops, after failing its tasks
            return
        with self._cond:
            self._batches_processed += 1
            self._rows_processed += total
        for i, task in enumerate(tasks):
            _deliver(task, tuple(s[i] for s in slices), None)

    def _drop_incompatible(self, tasks: list[_Task]) -> list[_Task]:
        """Fails, one by one, tasks whose tensors cannot be concatenated with the first task's."""
        first = tasks[0].args
        kept = [tasks[0]]
        for task in tasks[1:]:
            args = task.args
            if len(args) == len(first) and all(
                a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and a.device == b.device
                for a, b in zip(args, first)
            ):
                kept.append(task)
                continue
            _deliver(
                task,
                None,
                InvalidRequest(
                    f"task pool {self.name}: task tensors "
                    f"{[(tuple(a.shape), str(a.dtype)) for a in args]} do not match the batch's "
                    f"{[(tuple(b.shape), str(b.dtype)) for b in first]}"
                ),
            )
        return kept

    def __repr__(self) -> str:
        return f"TaskPool({self.name!r}, max_batch_size={self.max_batch_size})"


class Runtime:
    """Owns the one compute thread that runs every pool's batches.

    Usage::

        runtime = Runtime([forward_pool, backward_pool])
        runtime.start()
        ...  # callers await pool.submit(...)
        runtime.shutdown()

    Also a context manager (starts on enter, shuts down on exit).

    Args:
        pools: the pools to serve; their names must be unique. A pool belongs to one runtime.

    Raises:
        ValueError: no pools, duplicate names, or a pool that already belongs to a runtime.
    """

    def __init__(self, pools: Iterable[TaskPool]) -> None:
        pools = list(pools)
        if not pools:
            raise ValueError("a runtime needs at least one pool")
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        for pool in pools:
            if pool._runtime is not None:
                raise ValueError(f"pool {pool.name} already belongs to a runtime")
        self.pools: dict[str, TaskPool] = {p.name: p for p in pools}
        self._cond = threading.Condition()
        for pool in pools:
            pool._runtime = self
            pool._cond = self._cond
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._inflight: list[_Task] = []

    def start(self) -> None:
        """Starts the compute thread; pools accept tasks from now on.

        Raises:
            RuntimeError: already started (a runtime is started at most once).
        """
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("runtime already started")
            self._thread = threading.Thread(target=self._run, name="swarm-moe-runtime", daemon=True)
            for pool in self.pools.values():
                pool._accepting = True
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops accepting tasks, fails queued ones, and stops the compute thread.

        Queued tasks fail at once with `MoEError`. A batch already running is allowed up to
        `timeout` seconds to finish and deliver its results; if it does not, its tasks fail
        with `MoEError` too (the thread is a daemon and ends when the function returns).
        Idempotent.

        Args:
            timeout: seconds to wait for a running batch.
        """
        reason = "the runtime is shut down"
        self._fail_queued(reason)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("runtime: a batch is still running %.1f s after shutdown", timeout)
                with self._cond:
                    stuck, self._inflight = self._inflight, []
                for task in stuck:
                    _deliver(task, None, MoEError(f"{reason} while the task was running"))

    def _fail_queued(self, reason: str) -> None:
        with self._cond:
            self._stopping = True
            pending = [(pool, pool._drain(reason)) for pool in self.pools.values()]
            self._cond.notify_all()
        for pool, tasks in pending:
            for task in tasks:
                _deliver(task, None, MoEError(f"task pool {pool.name}: {reason} before the task ran"))

    def stats(self) -> dict[str, PoolStats]:
        """Returns each pool's counters, by pool name."""
        return {name: pool.stats() for name, pool in self.pools.items()}

    @property
    def is_running(self) -> bool:
        """Whether the compute thread is alive and not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _next_batch(self) -> tuple[TaskPool, list[_Task]] | None:
        """Blocks until some pool is ready; returns it and its batch, or None when stopping."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                best: TaskPool | None = None
                wake_at: float | None = None
                for pool in self.pools.values():
                    ready_at = pool._ready_at()
                    if ready_at is None:
                        continue
                    if ready_at <= now:
                        if best is None or pool._queue[0].enqueued_at < best._queue[0].enqueued_at:
                            best = pool
                    elif wake_at is None or ready_at < wake_at:
                        wake_at = ready_at
                if best is not None:
                    batch = best._take_batch()
                    self._inflight = batch
                    return best, batch
                self._cond.wait(None if wake_at is None else wake_at - now)
            return None

    def _run(self) -> None:
        try:
            while True:
                picked = self._next_batch()
                if picked is None:
                    return
                pool, batch = picked
                try:
                    pool._run_batch(batch)
                except Exception:  # a bug in the runtime itself: keep serving the other tasks
                    logger.exception("runtime: unexpected failure in pool %s", pool.name)
                finally:
                    with self._cond:
                        self._inflight = []
        finally:
            if not self._stopping:  # dying from KeyboardInterrupt/SystemExit: fail callers, never hang them
                self._fail_queued("the runtime's compute thread stopped unexpectedly")
