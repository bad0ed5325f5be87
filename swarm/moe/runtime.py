"""The batching runtime: one compute thread that runs the batches of several task pools.

One `Runtime` owns one dedicated compute thread that serves several `TaskPool`s
(`swarm.moe.task_pool`): among the pools that are ready, the one whose head task is oldest
goes first. Only that thread ever runs pool functions, so an
`swarm.moe.backend.ExpertBackend` needs no locking of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Self

from swarm.core.errors import MoEError
from swarm.moe.task_pool import PoolStats, ProcessFn, TaskPool, _deliver, _Task

__all__ = ["PoolStats", "ProcessFn", "Runtime", "TaskPool"]

logger = logging.getLogger(__name__)


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
        threads: torch intra-op threads of the compute thread (None: torch's default). Set in
            that thread, so the event loop's own torch calls stay out of the compute's pool.

    Raises:
        ValueError: no pools, duplicate names, or a pool that already belongs to a runtime.
    """

    def __init__(self, pools: Iterable[TaskPool], threads: int | None = None) -> None:
        pools = list(pools)
        if not pools:
            raise ValueError("a runtime needs at least one pool")
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        for pool in pools:
            if pool._runtime is not None:
                raise ValueError(f"pool {pool.name} already belongs to a runtime")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be positive or None, got {threads!r}")
        self.threads = threads
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
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
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
