"""How records are packed into requests: at most `max_keys_per_call` items and `BATCH_BYTES` of
values in one Store (stores, handoff to new nodes, caching after a get).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

BATCH_BYTES = 4 << 20
"""Most value bytes in one Store request (the transport caps messages at 8 MiB)."""


def chunks(items: Sequence[T], sizes: Sequence[int], max_items: int) -> list[list[T]]:
    """`items` cut into batches of at most `max_items` and `BATCH_BYTES` (a bigger item goes alone)."""
    batches: list[list[T]] = []
    current: list[T] = []
    total = 0
    for item, size in zip(items, sizes):
        if current and (len(current) >= max_items or total + size > BATCH_BYTES):
            batches.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    if current:
        batches.append(current)
    return batches
