"""The averager's round buffer, allocated once and reused from round to round.

A round needs one float32 buffer (reducer slots, then the results that reuse them). It stays
with the round until no other member can still ask for its results (every stream to this peer
closed, or the round's linger ran out); a round that starts before that gets a fresh buffer,
which happens only after faults, so a healthy run allocates once (fresh large allocations are
slow: BENCHMARKS.md, "Transport facts").
"""

from __future__ import annotations

import asyncio

import torch


class ScratchPool:
    """Hands out one reusable float32 buffer; `acquire` waits briefly for it before allocating another."""

    def __init__(self, wait: float = 0.25) -> None:
        self.wait = wait
        self._free: torch.Tensor | None = None
        self._in_use = 0
        self._released = asyncio.Event()

    async def acquire(self, numel: int) -> torch.Tensor:
        if self._free is None and self._in_use:
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), self.wait)
            except TimeoutError:
                pass
        buffer, self._free = self._free, None
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32)
        self._in_use += 1
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._in_use -= 1
        if self._free is None or buffer.numel() > self._free.numel():
            self._free = buffer
        self._released.set()
