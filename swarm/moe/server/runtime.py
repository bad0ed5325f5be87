"""The batching runtime: compute threads that run the batches of several task pools.

One `Runtime` owns one or more dedicated compute threads ("workers") that serve several
`TaskPool`s (`swarm.moe.server.task_pool`): among the pools that are ready, the one whose head task is
oldest goes first. Pools of one group (an expert's forward and backward pools) never run at the
same time, so an `swarm.moe.server.backend.ExpertBackend` needs no locking of its own.

Several workers share the machine's cores through a budget of torch intra-op threads: a batch
that runs alone gets the whole budget; when several groups have work, the budget is split among
that many workers (one thread each on two cores), and a batch starts only when a thread of the
budget is free. Two independent single-threaded batches use two cores better than one batch with
two threads after another, because parallel regions synchronize and the Python between the
kernels runs on one core (BENCHMARKS.md, "Measurements behind design choices"). Tasks meant to run side by side should be queued together
(`submit_together`): a batch that found the runtime idle has taken the whole budget, and tasks
of other groups arriving a moment later wait for it.
The split is set with `torch.set_num_threads` in the worker; part of that setting (MKL's) is
process-wide, so while batches run side by side other threads of the process see it too; it is
put back to the budget when they end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Self

from swarm.core.errors import MoEError, SwarmError
from swarm.moe.server.batch_runner import Task, deliver
from swarm.moe.server.task_pool import PoolStats, TaskPool

if TYPE_CHECKING:
    import torch

__all__ = ["Runtime"]

logger = logging.getLogger(__name__)


class Runtime:
    """Owns the compute threads that run every pool's batches.

    Usage::

        runtime = Runtime([forward_pool, backward_pool])
        runtime.start()
        ...  # callers await pool.submit(...)
        runtime.shutdown()

    Also a context manager (starts on enter, shuts down on exit).

    Args:
        pools: the pools to serve; their names must be unique. A pool belongs to one runtime.
        threads: torch intra-op threads the batches may use together (None: torch's default
            when there are several workers; with one worker, None leaves the thread's setting
            alone). Set in the compute threads, so the event loop's own torch calls stay out of
            the compute's pool.
        workers: compute threads, hence the most batches (of different groups) running at once;
            at most `threads` run at once, since each batch uses at least one thread.

    Raises:
        ValueError: no pools, duplicate names, a pool that already belongs to a runtime, or a
            non-positive `threads` or `workers`.
    """

    def __init__(self, pools: Iterable[TaskPool], threads: int | None = None, workers: int = 1) -> None:
        pools = list(pools)
        if not pools:
            raise ValueError("a runtime needs at least one pool")
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        for pool in pools:
            if pool.runtime is not None:
                raise ValueError(f"pool {pool.name} already belongs to a runtime")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be positive or None, got {threads!r}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.threads = threads
        self.workers = workers
        self.pools: dict[str, TaskPool] = {p.name: p for p in pools}
        self._cond = threading.Condition()
        for pool in pools:
            pool.runtime = self
            pool._cond = self._cond
        self._threads: list[threading.Thread] = []
        self._stopping = False
        # Guarded by _cond: groups with a batch running, intra-op threads they use, their tasks.
        self._budget: int | None = None
        self._used = 0
        self._busy: set[Hashable] = set()
        self._inflight: dict[int, list[Task]] = {}
        self._worker_threads: dict[int, int] = {}  # the OpenMP team size each worker last set
        self._process_threads: int | None = None  # what torch.set_num_threads was last called with

    def start(self) -> None:
        """Starts the compute threads; pools accept tasks from now on.

        Raises:
            RuntimeError: already started (a runtime is started at most once).
        """
        with self._cond:
            if self._threads:
                raise RuntimeError("runtime already started")
            self._budget = self.threads
            if self._budget is None and self.workers > 1:
                import torch

                self._budget = torch.get_num_threads()
            self._threads = [
                threading.Thread(target=self._run, args=(i,), name=f"swarm-moe-runtime-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for pool in self.pools.values():
                pool._accepting = True
            for thread in self._threads:
                thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops accepting tasks, fails queued ones, and stops the compute threads.

        Queued tasks fail at once with `MoEError`. Batches already running are allowed up to
        `timeout` seconds (together) to finish and deliver their results; if they do not, their
        tasks fail with `MoEError` too (the threads are daemons and end when the functions return).
        Idempotent.

        Args:
            timeout: seconds to wait for running batches.
        """
        reason = "the runtime is shut down"
        self._fail_queued(reason)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() and t is not threading.current_thread() for t in self._threads):
            logger.warning("runtime: a batch is still running %.1f s after shutdown", timeout)
            with self._cond:
                stuck = [task for tasks in self._inflight.values() for task in tasks]
                self._inflight.clear()
            for task in stuck:
                deliver(task, None, MoEError(f"{reason} while the task was running"))

    def submit_together(
        self, requests: Sequence[tuple[TaskPool, Sequence[torch.Tensor], Hashable | None]]
    ) -> list[asyncio.Future[tuple[torch.Tensor, ...]]]:
        """Queues several tasks at once: no worker sees some of them before all are queued, so
        tasks of different groups are spread over the workers from the start.

        Call it from an event loop; each request is ``(pool, tensors, tag)`` as for
        `TaskPool.submit`.

        Returns:
            One future per request, in order: a task of the running loop that resolves as
            `TaskPool.submit` would (cancelling it drops its task), or a future that already
            holds the error that refused the request at submission.

        Raises:
            ValueError: a pool does not belong to this runtime.
        """
        loop = asyncio.get_running_loop()
        queued: list[tuple[TaskPool, Task | None, SwarmError | None]] = []
        with self._cond:
            for pool, tensors, tag in requests:
                if pool.runtime is not self:
                    raise ValueError(f"pool {pool.name} does not belong to this runtime")
            # One arrival time for all: pools with the same batching delay become ready at the same
            # instant, so a worker that wakes for the first sees the others and splits the thread
            # budget (with a few microseconds between them it could take the whole budget for the
            # first and leave the rest queued behind it).
            now = time.monotonic()
            for pool, tensors, tag in requests:
                try:
                    queued.append((pool, pool._enqueue(tuple(tensors), tag, now), None))
                except SwarmError as e:
                    queued.append((pool, None, e))
        futures: list[asyncio.Future[tuple[torch.Tensor, ...]]] = []
        for pool, task, error in queued:
            if task is None:
                refused: asyncio.Future[tuple[torch.Tensor, ...]] = loop.create_future()
                refused.set_exception(error)  # type: ignore[arg-type]
                futures.append(refused)
            else:
                futures.append(asyncio.ensure_future(pool._wait(task)))
        return futures

    def _fail_queued(self, reason: str) -> None:
        with self._cond:
            self._stopping = True
            pending = [(pool, pool._drain(reason)) for pool in self.pools.values()]
            self._cond.notify_all()
        for pool, tasks in pending:
            for task in tasks:
                deliver(task, None, MoEError(f"task pool {pool.name}: {reason} before the task ran"))

    def stats(self) -> dict[str, PoolStats]:
        """Returns each pool's counters, by pool name."""
        return {name: pool.stats() for name, pool in self.pools.items()}

    @property
    def is_running(self) -> bool:
        """Whether the compute threads are alive and not stopping."""
        return any(t.is_alive() for t in self._threads) and not self._stopping

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _next_batch(self, worker: int) -> tuple[TaskPool, list[Task], int | None] | None:
        """Blocks until some pool is ready and threads are free; returns it, its batch and the
        intra-op threads it runs with (None: left alone), or None when stopping."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                best: TaskPool | None = None
                wake_at: float | None = None
                ready_groups: set[Hashable] = set()
                budget = self._budget
                if budget is None or self._used < budget:
                    for pool in self.pools.values():
                        if pool.group in self._busy:
                            continue  # the batch that ends there wakes us
                        ready_at = pool._ready_at()
                        if ready_at is None:
                            continue
                        if ready_at <= now:
                            ready_groups.add(pool.group)
                            if best is None or pool._queue[0].enqueued_at < best._queue[0].enqueued_at:
                                best = pool
                        elif wake_at is None or ready_at < wake_at:
                            wake_at = ready_at
                if best is not None:
                    threads = None
                    if budget is not None:
                        idle_workers = self.workers - len(self._inflight)
                        threads = max(1, (budget - self._used) // min(len(ready_groups), idle_workers))
                        self._used += threads
                        self._set_threads(worker, threads)
                    batch = best._take_batch()
                    self._busy.add(best.group)
                    self._inflight[worker] = batch
                    return best, batch, threads
                self._cond.wait(None if wake_at is None else wake_at - now)
            return None

    def _set_threads(self, worker: int, threads: int) -> None:
        # Lock held. torch.set_num_threads sets the calling thread's OpenMP team size, but MKL's is
        # process-wide: so it is set for every batch (the last writer wins), and put back to the
        # budget once no batch runs, for the other threads of the process.
        if self._worker_threads.get(worker) != threads or self._process_threads != threads:
            import torch

            torch.set_num_threads(threads)
            self._worker_threads[worker] = self._process_threads = threads

    def _finished(self, worker: int, group: Hashable, threads: int | None) -> None:
        with self._cond:
            self._inflight.pop(worker, None)
            self._busy.discard(group)
            if threads is not None:
                self._used -= threads
                if not self._inflight and self._budget is not None and self._process_threads != self._budget:
                    self._set_threads(worker, self._budget)
            self._cond.notify_all()

    def _run(self, worker: int) -> None:
        try:
            while True:
                picked = self._next_batch(worker)
                if picked is None:
                    return
                pool, batch, threads = picked
                try:
                    pool._run_batch(batch)
                except Exception:  # a bug in the runtime itself: keep serving the other tasks
                    logger.exception("runtime: unexpected failure in pool %s", pool.name)
                finally:
                    self._finished(worker, pool.group, threads)
        finally:
            if not self._stopping:  # dying from KeyboardInterrupt/SystemExit: fail callers, never hang them
                self._fail_queued("the runtime's compute thread stopped unexpectedly")
