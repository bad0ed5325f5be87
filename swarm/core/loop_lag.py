"""How late an asyncio loop runs its timers: what a benchmark or a test watches to show that work it
moved off the loop (a device copy, a large serialization) no longer stalls it."""

from __future__ import annotations

import asyncio
import threading

PERIOD = 0.01  # seconds between the probe's wake-ups


class LoopLag:
    """The largest lateness (seconds) of a `PERIOD` timer on `loop`, from construction to `stop()`.

    Args:
        loop: a running loop, on another thread (the peer's: `peer.loop.loop`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._future = asyncio.run_coroutine_threadsafe(self._probe(), loop)

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            before = loop.time()
            await asyncio.sleep(PERIOD)
            self.worst = max(self.worst, loop.time() - before - PERIOD)

    def stop(self, timeout: float = 5.0) -> float:
        """Ends the probe; returns the worst lateness seen."""
        self._stop.set()
        self._future.result(timeout)
        return self.worst
