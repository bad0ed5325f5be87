"""msgpack serialization for small structured values (DHT records, metadata).

Unpacking is bounded so a hostile peer cannot make us allocate without limit.
"""

from __future__ import annotations

from typing import Any

import msgpack

MAX_VALUE_BYTES = 1 << 20


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = MAX_VALUE_BYTES) -> Any:
    if len(data) > max_bytes:
        raise ValueError(f"msgpack value of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
