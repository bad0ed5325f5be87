"""A dictionary value: one DHT key holding subkeys, each with its own value and expiration.

Each subkey follows the store rule on its own (`storage.py`'s module docstring), and the
dictionary expires with its latest subkey. On the wire it is msgpack
`[[subkey, value, expiration_time], ...]`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import msgpack

from swarm.dht.expiring import ExpiringMap, ValueWithExpiration, check_bytes, check_expiration

_NEVER = -math.inf


class DictionaryValue(ExpiringMap):
    """A dictionary value: serialized subkey -> `ValueWithExpiration` of serialized bytes.

    Each subkey follows the store rule on its own; the dictionary expires with its latest
    subkey (`latest_expiration_time`). It keeps expired subkeys until `remove_outdated(now)`;
    `DHTLocalStorage` purges them before handing a dictionary out.
    """

    def __init__(self, items: Iterable[tuple[bytes, bytes, float]] = ()) -> None:
        super().__init__()
        self._latest = _NEVER
        for subkey, value, expiration_time in items:
            self.store(subkey, value, expiration_time)

    @property
    def latest_expiration_time(self) -> float:
        """The latest expiration of any subkey (-inf when empty): the dictionary's expiration."""
        return self._latest

    def store(self, subkey: bytes, value: bytes, expiration_time: float) -> bool:
        """Stores a subkey unless it already holds one expiring later or at the same time."""
        check_bytes(subkey=subkey, value=value)
        check_expiration(expiration_time)
        current = self._data.get(subkey)
        if current is not None and current.expiration_time >= expiration_time:
            return False
        self._set(subkey, value, expiration_time)
        self._latest = max(self._latest, expiration_time)
        return True

    def get(self, subkey: bytes) -> ValueWithExpiration | None:
        return self._data.get(subkey)

    def items(self) -> Iterator[tuple[bytes, ValueWithExpiration]]:
        return iter(list(self._data.items()))

    def remove_outdated(self, now: float) -> None:
        """Drops subkeys that expired at or before `now`."""
        self._remove_outdated(now)
        if not self._data:
            self._latest = _NEVER

    def copy(self) -> DictionaryValue:
        return DictionaryValue((k, v.value, v.expiration_time) for k, v in self._data.items())

    def packb(self) -> bytes:
        """Serializes to msgpack `[[subkey, value, expiration_time], ...]` for the wire."""
        return msgpack.packb(
            [[k, v.value, float(v.expiration_time)] for k, v in self._data.items()], use_bin_type=True
        )

    @classmethod
    def unpackb(cls, data: bytes) -> DictionaryValue:
        """Parses `packb` output.

        Raises:
            ValueError: `data` is not a serialized dictionary value.
        """
        try:
            rows = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError) as e:  # msgpack's errors for bad input
            raise ValueError(f"not a serialized dictionary value: {e}") from e
        result = cls()
        for row in rows if isinstance(rows, list) else [rows]:
            if not (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], bytes)
                and isinstance(row[1], bytes)
                and isinstance(row[2], int | float)
                and not isinstance(row[2], bool)
            ):
                raise ValueError(f"not a serialized dictionary value: bad row {row!r:.80}")
            result.store(row[0], row[1], float(row[2]))
        return result

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DictionaryValue):
            return NotImplemented
        return self._data == other._data

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"DictionaryValue({dict(self._data)!r})"
