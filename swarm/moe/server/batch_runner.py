"""Running one batch of a task pool, on a compute thread: merge its tasks, call the function,
hand each caller its own rows.

The tasks are concatenated along dim 0 (one task alone is passed as is), the pool's function
runs once on the batch, and its outputs are split back by rows; each caller gets its slice on
its own event loop through ``loop.call_soon_threadsafe``.

Faults are per batch and per task: a task whose tensors cannot be concatenated with the
batch's first task fails alone (`InvalidRequest`); if the function raises, every task of that
batch fails with the error (a `SwarmError` as raised, anything else wrapped in `MoEError`) and
the runtime goes on with the next batch.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from swarm.core.errors import InvalidRequest, MoEError, SwarmError

logger = logging.getLogger(__name__)

ProcessFn = Callable[..., "Sequence[torch.Tensor] | torch.Tensor"]
"""A batch function: takes tensors sharing a leading batch dim, returns tensors with the same."""


@dataclass(eq=False)
class Task:
    args: tuple[torch.Tensor, ...]
    rows: int
    future: asyncio.Future[tuple[torch.Tensor, ...]]
    loop: asyncio.AbstractEventLoop
    tag: Hashable | None = None
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


def deliver(task: Task, result: tuple[torch.Tensor, ...] | None, error: BaseException | None) -> None:
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


class BatchRunner:
    """The compute side of a `swarm.moe.server.task_pool.TaskPool`: runs one batch of its tasks.

    `TaskPool` extends it with the queue the batches come from, and sets the attributes below.
    """

    process_fn: ProcessFn
    name: str
    pass_tags: bool
    _cond: threading.Condition  # guards the counters
    _batches_processed: int
    _rows_processed: int
    _batches_failed: int

    def _run_batch(self, tasks: list[Task]) -> None:
        """Runs one batch and delivers the results. Called on a compute thread, lock NOT held."""
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
            if self.pass_tags:
                outputs = self.process_fn(*inputs, tags=[t.tag for t in tasks])
            else:
                outputs = self.process_fn(*inputs)
            results = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
            for i, out in enumerate(results):
                if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != total:
                    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise MoEError(
                        f"task pool {self.name}: output {i} is {shape}, expected a tensor with {total} rows"
                    )
            slices = [torch.split(out, rows, dim=0) for out in results]
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
                deliver(task, None, _per_task_error(error))
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt / SystemExit: the thread stops, after failing its tasks
            return
        with self._cond:
            self._batches_processed += 1
            self._rows_processed += total
        for i, task in enumerate(tasks):
            deliver(task, tuple(s[i] for s in slices), None)

    def _drop_incompatible(self, tasks: list[Task]) -> list[Task]:
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
            deliver(
                task,
                None,
                InvalidRequest(
                    f"task pool {self.name}: task tensors "
                    f"{[(tuple(a.shape), str(a.dtype)) for a in args]} do not match the batch's "
                    f"{[(tuple(b.shape), str(b.dtype)) for b in first]}"
                ),
            )
        return kept
