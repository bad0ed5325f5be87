"""Per-thread scratch buffers, so that encoding and decoding chunks does not allocate per call.

Fresh large allocations cost page faults (BENCHMARKS.md, "Transport facts"), so codecs reuse one buffer per (purpose, dtype) and thread. Buffers up to
`MAX_RETAINED_BYTES` are kept for the thread's lifetime; larger requests (a whole big tensor
encoded as one payload) get a temporary that is freed after use, which bounds the memory kept.
"""

from __future__ import annotations

import threading

import torch

MAX_RETAINED_BYTES = 16 << 20


class Workspace(threading.local):
    """Scratch tensors of one thread, keyed by purpose and dtype."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, purpose: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Returns a 1-D contiguous tensor of `numel` elements with undefined contents.

        The tensor stays valid until the next `get` with the same purpose and dtype on this thread.
        """
        key = (purpose, dtype)
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.numel() >= numel:
            return buffer[:numel]
        buffer = torch.empty(max(numel, 1), dtype=dtype)
        if buffer.numel() * buffer.element_size() <= MAX_RETAINED_BYTES:
            self._buffers[key] = buffer
        return buffer[:numel]


workspace = Workspace()
