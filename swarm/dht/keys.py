"""How user keys and subkeys become the bytes the DHT hashes, stores and sends.

A user key (`str` or `bytes`) is serialized with msgpack (so `"a"` and `b"a"` are different
keys) and its DHT key is the sha256 of that serialization (`DHTID.from_key`). Subkeys are
serialized the same way and travel in the clear; the empty byte string means "no subkey",
which no msgpack serialization can be confused with.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

Key = str | bytes
Subkey = str | bytes | int

NO_SUBKEY = b""
"""The serialized subkey of a record that has no subkey (a plain value)."""


def serialize_key(key: Key) -> bytes:
    """The msgpack form of a user key: what is hashed into the key's DHTID.

    Raises:
        TypeError: `key` is neither `str` nor `bytes`.
    """
    if not isinstance(key, str | bytes):
        raise TypeError(f"a DHT key is str or bytes, got {type(key).__name__}")
    return msgpack.packb(key, use_bin_type=True)


def hash_serialized_key(raw_key: bytes) -> bytes:
    """The 32-byte DHT key (sha256) of a serialized key, as `DHTID.from_key(key).to_bytes()`."""
    return hashlib.sha256(raw_key).digest()


def key_to_bytes(key: Key) -> bytes:
    """The 32-byte DHT key of a user key (the storage and wire form)."""
    return hash_serialized_key(serialize_key(key))


def deserialize_key(raw_key: bytes) -> Key:
    """The user key back from its msgpack form.

    Raises:
        ValueError: `raw_key` is not the serialization of a `str` or `bytes` key.
    """
    try:
        key = msgpack.unpackb(raw_key, raw=False)
    except (ValueError, TypeError) as e:  # msgpack's errors for bad input
        raise ValueError(f"not a serialized DHT key: {e}") from e
    if isinstance(key, str | bytes):
        return key
    raise ValueError(f"a serialized DHT key holds str or bytes, not {type(key).__name__}")


def serialize_subkey(subkey: Subkey | None) -> bytes:
    """The msgpack form of a subkey; `None` (no subkey) becomes `NO_SUBKEY` (empty bytes).

    Raises:
        TypeError: `subkey` is not `str`, `bytes`, `int` or `None`.
    """
    if subkey is None:
        return NO_SUBKEY
    if isinstance(subkey, bool) or not isinstance(subkey, str | bytes | int):
        raise TypeError(f"a DHT subkey is str, bytes or int, got {type(subkey).__name__}")
    return msgpack.packb(subkey, use_bin_type=True)


def deserialize_subkey(data: bytes) -> Any:
    """The user subkey back from `serialize_subkey`'s output (`None` for `NO_SUBKEY`).

    Raises:
        ValueError: `data` is not valid msgpack.
    """
    if data == NO_SUBKEY:
        return None
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:  # msgpack's errors for bad input
        raise ValueError(f"not a serialized DHT subkey: {e}") from e
