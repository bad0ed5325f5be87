"""The expiring map the DHT's stores build on: entries with expiration times, purged cheaply.

`ValueWithExpiration` is what every store holds and returns; `ExpiringMap` keeps a min-heap over
the expiration times so a purge costs O(log n) per expired entry. `DictionaryValue`
(`dictionary_value.py`) and `DHTLocalStorage` (`storage.py`) are both expiring maps.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, NamedTuple


class ValueWithExpiration(NamedTuple):
    """A value and the time (seconds since the epoch) after which it no longer exists.

    `value` is serialized bytes for a plain value and a `DictionaryValue` for a dictionary.
    """

    value: Any
    expiration_time: float


def subkey_entries(found: ValueWithExpiration | None) -> dict[object, ValueWithExpiration]:
    """The entries of a dictionary value as `DHT.aget` returns it (subkey -> its own value and
    expiration), typed; empty where `found` is None or holds a plain value. Callers read
    ``entry.value`` and ``entry.expiration_time`` from here instead of probing what a read gave."""
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: entry for subkey, entry in found.value.items() if isinstance(entry, ValueWithExpiration)}


class ExpiringMap:
    """A dict whose entries carry expiration times, with a lazy min-heap over them.

    A heap entry (expiration, key) is live only while the entry's current expiration still
    equals it; stale entries are skipped when popped and the heap is rebuilt when mostly stale.
    """

    def __init__(self) -> None:
        self._data: dict[bytes, ValueWithExpiration] = {}
        self._heap: list[tuple[float, bytes]] = []

    def _set(self, key: bytes, value: object, expiration_time: float) -> None:
        self._data[key] = ValueWithExpiration(value, expiration_time)
        heapq.heappush(self._heap, (expiration_time, key))
        if len(self._heap) > 2 * len(self._data) + 64:
            self._heap = [(entry.expiration_time, k) for k, entry in self._data.items()]
            heapq.heapify(self._heap)

    def _is_live_heap_entry(self, expiration_time: float, key: bytes) -> bool:
        entry = self._data.get(key)
        return entry is not None and entry.expiration_time == expiration_time

    def _dropped(self, key: bytes) -> None:
        """Called whenever an entry leaves the map (expired or evicted); for subclasses."""

    def _pop_soonest(self) -> tuple[bytes, ValueWithExpiration] | None:
        while self._heap:
            expiration_time, key = heapq.heappop(self._heap)
            if self._is_live_heap_entry(expiration_time, key):
                entry = self._data.pop(key)
                self._dropped(key)
                return key, entry
        return None

    def _soonest_expiration(self) -> float | None:
        while self._heap and not self._is_live_heap_entry(*self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def _remove_outdated(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            expiration_time, key = heapq.heappop(self._heap)
            if self._is_live_heap_entry(expiration_time, key):
                del self._data[key]
                self._dropped(key)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data


def check_bytes(**values: object) -> None:
    """Raises TypeError unless every named argument is bytes (shared by the stores)."""
    for name, value in values.items():
        if not isinstance(value, bytes):
            raise TypeError(f"{name} must be bytes, got {type(value).__name__}")


def check_expiration(expiration_time: float) -> None:
    """Raises TypeError/ValueError unless `expiration_time` is a real number (not bool, not NaN)."""
    if isinstance(expiration_time, bool) or not isinstance(expiration_time, int | float):
        raise TypeError(f"expiration_time must be a number, got {type(expiration_time).__name__}")
    if math.isnan(expiration_time):
        raise ValueError("expiration_time is NaN")
