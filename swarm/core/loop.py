"""The peer's event loop: one asyncio loop (uvloop where installed) in a background thread.

Synchronous training code reaches it through one bridge, `LoopThread.run`, which submits a
coroutine, waits with a timeout and re-raises its exception. Code already inside another
event loop (a Jupyter cell) uses `LoopThread.wrap`, which returns an awaitable for that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import TypeVar

from swarm.core.collector import release_at_exit
from swarm.core.signals import block_stop_signals

T = TypeVar("T")
logger = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Owns an event loop running forever in a daemon thread until `stop()`."""

    def __init__(self, name: str = "swarm-loop") -> None:
        release_at_exit()  # gRPC objects left in reference cycles are freed before the interpreter finalizes
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        block_stop_signals()  # Ctrl+C is the main thread's (a notebook's, a daemon's signal thread's)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[object, None, T]) -> concurrent.futures.Future[T]:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the peer has been shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        """Runs `coro` on the loop and blocks until it finishes; cancels it on timeout."""
        if self.in_loop_thread:
            coro.close()
            raise RuntimeError("blocking swarm call made from inside the peer's event loop; use the a* form")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None
        except BaseException:
            future.cancel()
            raise

    async def wrap(self, coro: Coroutine[object, None, T]) -> T:
        """Awaitable form for callers inside any event loop (including this one)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout: float = 5.0) -> None:
        """Cancels what still runs on the loop, stops it and joins the thread."""
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            async def _cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                # Close the async generators left suspended, grpc's stream readers among them:
                # each holds its call, and a live call keeps grpc.aio's poller thread running
                # into the interpreter's exit, where it can abort the process ("terminate called
                # without an active exception") as it takes the GIL.
                await self.loop.shutdown_asyncgens()

            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout)
            except Exception:
                logger.debug("tasks did not all cancel at shutdown", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
        else:  # it stays a daemon thread: should the process exit now, it is stopped mid-callback
            logger.warning("the peer's event loop did not stop within %.0f s of its shutdown", timeout)


def spawn(coro: Coroutine[object, None, T], name: str) -> asyncio.Task[T]:
    """Starts an owned, named background task whose failure is logged, never lost."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task %s failed", task.get_name(), exc_info=task.exception())
