"""What one DHT node stores: values with expiration times, plain or as dictionaries of subkeys.

The rules (docs/protocol.md, "DHT records") in one place:

- Every value carries an expiration time; an expired value (or subkey) is never returned and is
  purged lazily on access and by `remove_outdated()` (a heap, so a purge costs O(log n) per
  expired record).
- A store with a later expiration replaces an earlier one; a store whose expiration is earlier
  than or equal to the stored one is refused (returns False) and changes nothing, so replicas
  that see the same stores in any order converge (Kademlia §2.5 republishing stays idempotent).
- A key may hold a dictionary of subkeys, each with its own value and expiration; the
  dictionary's expiration is the latest of its subkeys'.
- Plain value vs dictionary: the incoming record is compared with the stored record's overall
  expiration. A plain value replaces a dictionary only if it expires later than every subkey;
  a subkey (or a whole dictionary) replaces a plain value only if it expires later than it.
  Ties keep what is stored.

Keys are the 32-byte DHT keys (`DHTID.to_bytes()`), subkeys their serialized form
(`swarm.dht.keys.serialize_subkey`), and values the serialized bytes exactly as they arrived,
so a node can forward them (signatures included) untouched. Next to each record the storage
keeps the serialized original key (`raw_key`, whose sha256 is the DHT key), which receivers
need to check owner markers and schemas, so that replication and republication can forward it
too, and when a store for the key last arrived (Kademlia §2.5: a node that received a store
recently need not republish the record).

Quotas (`StorageQuota`) bound what one writer can make a node hold, so that no stranger can
fill its memory or make a key unwritable: bytes in all, bytes and subkeys per key, and bytes
and records per writer, and bytes and records per source network. The writer of a record is
whoever the node holds responsible: the owner its key or subkey names (its signature proved it),
else the caller that sent it; its source is the network the store came from (the caller's /24 or
/64), so that one host bringing many identities still gets one network's share. Records a node
stores for itself are charged to no writer and no source. A store past a quota is refused (and
`last_refusal` says which one); nothing already stored is evicted for it.

`watch(key, callback)` calls `callback()` each time a store changes `key`'s record here (the
progress tracker of a peer that is one of its run's replicas follows the others' reports that
way, without asking the network: `swarm.optim.tracker`).

`ValueWithExpiration` (from `expiring.py`, with the expiring map both stores build on) and
`DictionaryValue` (from `dictionary_value.py`) are re-exported here.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.expiring import ExpiringMap, ValueWithExpiration, check_bytes, check_expiration

logger = logging.getLogger(__name__)

__all__ = ["CacheStorage", "DHTLocalStorage", "StorageQuota", "latest", "merge", "merge_all"]

_RECORD_OVERHEAD = 64
"""Bytes a record is charged beyond its value and subkey (the bookkeeping around it)."""


@dataclass(frozen=True)
class StorageQuota:
    """What a storage holds at most; None: no limit.

    Attributes:
        max_bytes: Bytes of every record together.
        max_key_bytes: Bytes of one key's records (all its subkeys).
        max_subkeys: Subkeys of one key.
        max_writer_bytes: Bytes of one writer's records.
        max_writer_records: Records (plain values and subkeys) of one writer.
        max_source_bytes: Bytes of the records that came from one source network.
        max_source_records: Records that came from one source network.
    """

    max_bytes: int | None = None
    max_key_bytes: int | None = None
    max_subkeys: int | None = None
    max_writer_bytes: int | None = None
    max_writer_records: int | None = None
    max_source_bytes: int | None = None
    max_source_records: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_key_bytes", "max_subkeys", "max_writer_bytes", "max_writer_records",
                     "max_source_bytes", "max_source_records"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                raise ValueError(f"StorageQuota.{name} must be >= 1 or None, got {limit}")


class _Charge(NamedTuple):
    writer: str | None
    nbytes: int
    received: float
    source: str | None = None

    def accounts(self) -> tuple[str, ...]:
        """The accounts this record is charged to: its writer's, and its source network's ("net:" first)."""
        if self.source is None:
            return () if self.writer is None else (self.writer,)
        net = "net:" + self.source
        return (net,) if self.writer is None else (self.writer, net)


class DHTLocalStorage(ExpiringMap):
    """The records this node is responsible for (Kademlia §2.3 STORE targets).

    Args:
        max_size: Most records (keys) to hold; when full, the record expiring soonest is
            evicted to make room, and a new record expiring no later than it is refused.
            None: unbounded.
        clock: Time source.
        quota: Byte, subkey and per-writer limits (see the module docstring).
    """

    def __init__(
        self, max_size: int | None = None, clock: Callable[[], float] = time.time, quota: StorageQuota | None = None
    ) -> None:
        super().__init__()
        if max_size is not None and max_size < 1:
            raise ValueError(f"max_size must be >= 1 or None, got {max_size}")
        self.max_size = max_size
        self.quota = quota or StorageQuota()
        self._clock = clock
        self._raw_keys: dict[bytes, bytes] = {}
        self._received: dict[bytes, float] = {}
        self._charges: dict[bytes, dict[bytes, _Charge]] = {}  # key -> subkey (b"" if plain) -> charge
        self._key_bytes: dict[bytes, int] = {}
        self._writer_bytes: dict[str, int] = {}
        self._writer_records: dict[str, int] = {}
        self.nbytes = 0
        """Bytes charged for every record held."""
        self.last_refusal: str | None = None
        """Why the last refused store was refused, if a quota refused it (else None)."""
        self._watchers: dict[bytes, list[Callable[[], None]]] = {}

    def watch(self, key: bytes, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback()` after each store that changes `key`'s record here; returns the
        function that stops it. The callback runs inside the store, so it must be quick and must
        not store into this storage (the tracker's sets an event)."""
        check_bytes(key=key)
        self._watchers.setdefault(key, []).append(callback)

        def unwatch() -> None:
            callbacks = self._watchers.get(key, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._watchers.pop(key, None)

        return unwatch

    def _changed(self, key: bytes) -> None:
        for callback in list(self._watchers.get(key, ())):
            try:
                callback()
            except Exception:  # a watcher's bug must not fail the store that woke it
                logger.exception("a watcher of a DHT key failed")

    def store(
        self,
        key: bytes,
        value: bytes,
        expiration_time: float,
        subkey: bytes | None = None,
        raw_key: bytes | None = None,
        writer: str | None = None,
        source: str | None = None,
    ) -> bool:
        """Stores a plain value, or one subkey of a dictionary value.

        Args:
            key: The 32-byte DHT key.
            value: The serialized value.
            expiration_time: When the value stops existing.
            subkey: The serialized subkey, or None (or empty bytes) for a plain value.
            raw_key: The serialized original key (its sha256 is `key`), kept with the record
                so it can be forwarded; None keeps what is already known.
            writer: Who is charged for the record (its owner, else the caller); None: nobody.
            source: The network the store came from, charged too; None (or ""): none.

        Returns:
            True if stored; False if already expired or not newer than what is stored (see
            the module docstring for plain-vs-dictionary), or refused for lack of space or
            past a quota (`last_refusal` then says which).

        Raises:
            ValueError: `raw_key` does not hash to `key`.
        """
        check_bytes(key=key, value=value)
        if subkey is not None and not isinstance(subkey, bytes):
            raise TypeError(f"subkey must be bytes or None, got {type(subkey).__name__}")
        check_expiration(expiration_time)
        _check_raw_key(key, raw_key)
        self.last_refusal = None
        stored = self._store(key, value, expiration_time, subkey, writer, source or None)
        if stored:
            self.mark_received(key, raw_key)
            if self._watchers:
                self._changed(key)
        return stored

    def mark_received(self, key: bytes, raw_key: bytes | None = None) -> None:
        """Records that a store for `key` arrived now (stored or not: §2.5 republishing)."""
        if key in self._data:
            self._received[key] = self._clock()
            if raw_key is not None:
                self._raw_keys[key] = raw_key

    def raw_key(self, key: bytes) -> bytes | None:
        """The serialized original key of the record under `key`, if known."""
        return self._raw_keys.get(key)

    def last_received(self, key: bytes) -> float | None:
        """When a store for `key` last arrived (None if there is no such record)."""
        return self._received.get(key)

    def _dropped(self, key: bytes) -> None:
        self._raw_keys.pop(key, None)
        self._received.pop(key, None)
        self._release_key(key)

    # -- quota bookkeeping --------------------------------------------------------------------------

    def _release_key(self, key: bytes) -> None:
        charges = self._charges.pop(key, None)
        if charges is None:
            return
        for charge in charges.values():
            self._uncharge(charge)
        self._key_bytes.pop(key, None)

    def _uncharge(self, charge: _Charge) -> None:
        self.nbytes -= charge.nbytes
        for writer in charge.accounts():
            left = self._writer_bytes[writer] - charge.nbytes
            records = self._writer_records[writer] - 1
            if records:
                self._writer_bytes[writer], self._writer_records[writer] = left, records
            else:
                del self._writer_bytes[writer], self._writer_records[writer]

    def _charge(self, key: bytes, subkey: bytes, charge: _Charge) -> None:
        charges = self._charges.setdefault(key, {})
        old = charges.get(subkey)
        if old is not None:
            self._uncharge(old)
            self._key_bytes[key] -= old.nbytes
        charges[subkey] = charge
        self._key_bytes[key] = self._key_bytes.get(key, 0) + charge.nbytes
        self.nbytes += charge.nbytes
        for writer in charge.accounts():
            self._writer_bytes[writer] = self._writer_bytes.get(writer, 0) + charge.nbytes
            self._writer_records[writer] = self._writer_records.get(writer, 0) + 1

    def _reconcile(self, key: bytes, dictionary: DictionaryValue) -> None:
        """Releases the charges of subkeys that expired inside a dictionary."""
        charges = self._charges.get(key)
        if charges is None or len(charges) == len(dictionary):
            return
        for subkey in [s for s in charges if s not in dictionary]:
            charge = charges.pop(subkey)
            self._uncharge(charge)
            self._key_bytes[key] -= charge.nbytes

    def _refusal(self, key: bytes, subkey: bytes, nbytes: int, charge: _Charge, replaces_key: bool) -> str | None:
        """Why storing `nbytes` under (key, subkey) for the charge's writer and source would break a quota, or None."""
        quota = self.quota
        charges = self._charges.get(key, {})
        if replaces_key:
            freed_key, old = self._key_bytes.get(key, 0), None
        else:
            old = charges.get(subkey)
            freed_key = old.nbytes if old is not None else 0
        if quota.max_bytes is not None and self.nbytes - freed_key + nbytes > quota.max_bytes:
            return f"the node holds {self.nbytes} bytes of records, its limit of {quota.max_bytes}"
        key_bytes = 0 if replaces_key else self._key_bytes.get(key, 0) - freed_key
        if quota.max_key_bytes is not None and key_bytes + nbytes > quota.max_key_bytes:
            return f"the key holds {key_bytes} bytes, and {quota.max_key_bytes} is the limit per key"
        if (
            subkey
            and quota.max_subkeys is not None
            and not replaces_key
            and old is None
            and len(charges) >= quota.max_subkeys
        ):
            return f"the key holds {len(charges)} subkeys, the limit per key"
        replaced = tuple(charges.values()) if replaces_key else (old,) if old is not None else ()
        for account in charge.accounts():
            held = self._writer_bytes.get(account, 0)
            records = self._writer_records.get(account, 0)
            for previous in replaced:
                if account in previous.accounts():
                    held -= previous.nbytes
                    records -= 1
            if account.startswith("net:"):
                max_bytes, max_records, whose = quota.max_source_bytes, quota.max_source_records, "source network"
            else:
                max_bytes, max_records, whose = quota.max_writer_bytes, quota.max_writer_records, "writer"
            if max_bytes is not None and held + nbytes > max_bytes:
                return f"the {whose} holds {held} bytes here, and {max_bytes} is the limit per {whose}"
            if max_records is not None and records + 1 > max_records:
                return f"the {whose} holds {records} records here, the limit per {whose}"
        return None

    # -- storing --------------------------------------------------------------------------------------

    def _store(
        self, key: bytes, value: bytes, expiration_time: float, subkey: bytes | None, writer: str | None = None,
        source: str | None = None,
    ) -> bool:
        now = self._clock()
        if expiration_time <= now:
            return False
        current = self._live(key, now)
        sub = subkey or b""
        nbytes = len(value) + len(sub) + _RECORD_OVERHEAD
        charge = _Charge(writer, nbytes, now, source)
        if not subkey:
            if current is not None and current.expiration_time >= expiration_time:
                return False
            if not self._allowed(key, sub, charge, replaces_key=True):
                return False
            if not self._put(key, value, expiration_time, is_new=current is None, now=now):
                return False
            self._release_key(key)
            self._charge(key, sub, charge)
            return True
        if current is None or not isinstance(current.value, DictionaryValue):
            if current is not None and current.expiration_time >= expiration_time:
                return False
            if not self._allowed(key, sub, charge, replaces_key=True):
                return False
            dictionary = DictionaryValue([(subkey, value, expiration_time)])
            if not self._put(key, dictionary, expiration_time, is_new=current is None, now=now):
                return False
            self._release_key(key)
            self._charge(key, sub, charge)
            return True
        dictionary = current.value
        existing = dictionary.get(subkey)
        if existing is not None and existing.expiration_time >= expiration_time:
            return False
        if not self._allowed(key, sub, charge, replaces_key=False):
            return False
        dictionary.store(subkey, value, expiration_time)
        self._charge(key, sub, charge)
        if dictionary.latest_expiration_time > current.expiration_time:
            self._set(key, dictionary, dictionary.latest_expiration_time)
        return True

    def _allowed(self, key: bytes, subkey: bytes, charge: _Charge, replaces_key: bool) -> bool:
        refusal = self._refusal(key, subkey, charge.nbytes, charge, replaces_key)
        if refusal is not None and self._heap and self._heap[0][0] <= self._clock():
            self.remove_outdated()  # expired records may still be charged: purge them, then look again
            refusal = self._refusal(key, subkey, charge.nbytes, charge, replaces_key)
        if refusal is not None:
            self.last_refusal = refusal
        return refusal is None

    def store_dictionary(
        self, key: bytes, dictionary: DictionaryValue, raw_key: bytes | None = None, writer: str | None = None
    ) -> bool:
        """Merges a whole dictionary value (for example, one received from another node).

        A stored dictionary takes each subkey by the per-subkey rule; a stored plain value is
        replaced by the dictionary only if the dictionary expires later.

        Returns:
            True if anything was stored.
        """
        check_bytes(key=key)
        if not isinstance(dictionary, DictionaryValue):
            raise TypeError(f"dictionary must be a DictionaryValue, got {type(dictionary).__name__}")
        _check_raw_key(key, raw_key)
        self.last_refusal = None
        stored = self._store_dictionary(key, dictionary, writer)
        if stored:
            self.mark_received(key, raw_key)
            if self._watchers:
                self._changed(key)
        return stored

    def _store_dictionary(self, key: bytes, dictionary: DictionaryValue, writer: str | None) -> bool:
        now = self._clock()
        incoming = [(s, v, e) for s, (v, e) in dictionary.items() if e > now]
        if not incoming:
            return False
        current = self._live(key, now)
        if (
            current is not None
            and not isinstance(current.value, DictionaryValue)
            and current.expiration_time >= max(e for _, _, e in incoming)
        ):
            return False
        # latest first: the first subkey replaces a plain value it outlives, the others join it
        incoming.sort(key=lambda row: -row[2])
        stored_any = False
        for subkey, value, expiration_time in incoming:
            stored_any = self._store(key, value, expiration_time, subkey, writer) or stored_any
        return stored_any

    def get(self, key: bytes) -> ValueWithExpiration | None:
        """The live record under `key`: bytes, or a `DictionaryValue` copy holding live subkeys only."""
        now = self._clock()
        current = self._live(key, now)
        if current is None or not isinstance(current.value, DictionaryValue):
            return current
        return ValueWithExpiration(current.value.copy(), current.expiration_time)

    def items(self) -> Iterator[tuple[bytes, ValueWithExpiration]]:
        """Every live record, as `get` would return it (a snapshot)."""
        now = self._clock()
        self.remove_outdated()
        for key in list(self._data):
            record = self._live(key, now)
            if record is None:
                continue
            if isinstance(record.value, DictionaryValue):
                record = ValueWithExpiration(record.value.copy(), record.expiration_time)
            yield key, record

    def live_keys(self) -> list[bytes]:
        """The keys of every live record (a snapshot)."""
        self.remove_outdated()
        return list(self._data)

    def remove_outdated(self) -> None:
        """Purges every record that has expired."""
        self._remove_outdated(self._clock())

    def _live(self, key: bytes, now: float) -> ValueWithExpiration | None:
        """The stored record if it has not expired (purging it, or its expired subkeys, if so)."""
        record = self._data.get(key)
        if record is None:
            return None
        if record.expiration_time <= now:
            del self._data[key]  # its heap entry goes stale and is skipped later
            self._dropped(key)
            return None
        if isinstance(record.value, DictionaryValue):
            record.value.remove_outdated(now)
            self._reconcile(key, record.value)
        return record

    def _put(self, key: bytes, value: object, expiration_time: float, is_new: bool, now: float) -> bool:
        if is_new and self.max_size is not None and len(self._data) >= self.max_size:
            self._remove_outdated(now)
            if len(self._data) >= self.max_size:
                soonest = self._soonest_expiration()
                if soonest is not None and soonest >= expiration_time:
                    return False  # it would be the first to go
                self._pop_soonest()
        self._set(key, value, expiration_time)
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(records={len(self)}, max_size={self.max_size})"


class CacheStorage(DHTLocalStorage):
    """Values cached from lookups (Kademlia §2.3 caching), kept apart from `DHTLocalStorage`.

    Same rules; bounded by default so caching can never crowd out the records this node is
    responsible for. The caller picks a cached value's expiration (§2.3: shorter the farther
    this node is from the key) and never republishes cached values.
    """

    def __init__(
        self, max_size: int | None = 10_000, clock: Callable[[], float] = time.time, quota: StorageQuota | None = None
    ) -> None:
        super().__init__(max_size=max_size, clock=clock, quota=quota)

    def get_fresh(self, key: bytes, max_age: float) -> ValueWithExpiration | None:
        """The cached record under `key` if a store for it arrived (`mark_received`) within the
        last `max_age` seconds, else None (it may still be there for `get`)."""
        received = self.last_received(key)
        if received is None or self._clock() - received >= max_age:
            return None
        return self.get(key)


def latest(a: ValueWithExpiration | None, b: ValueWithExpiration | None) -> ValueWithExpiration | None:
    """The one of two results that expires later (`a` on a tie); None only if both are None."""
    if a is None:
        return b
    if b is None:
        return a
    return b if b.expiration_time > a.expiration_time else a


def merge(a: ValueWithExpiration | None, b: ValueWithExpiration | None) -> ValueWithExpiration | None:
    """Combines two nodes' answers for one key, by the same rules as `DHTLocalStorage`.

    Two dictionaries merge subkey by subkey (the later expiration of each subkey wins);
    otherwise the record expiring later wins, `a` on a tie. Neither input is modified.
    """
    if (
        a is not None
        and b is not None
        and isinstance(a.value, DictionaryValue)
        and isinstance(b.value, DictionaryValue)
    ):
        merged = a.value.copy()
        for subkey, (value, expiration_time) in b.value.items():
            merged.store(subkey, value, expiration_time)
        return ValueWithExpiration(merged, merged.latest_expiration_time)
    return latest(a, b)


def merge_all(results: Iterable[ValueWithExpiration | None]) -> ValueWithExpiration | None:
    """Folds `merge` over any number of answers (None for nodes that had nothing)."""
    merged: ValueWithExpiration | None = None
    for result in results:
        merged = merge(merged, result)
    return merged


def _check_raw_key(key: bytes, raw_key: bytes | None) -> None:
    if raw_key is None:
        return
    if not isinstance(raw_key, bytes):
        raise TypeError(f"raw_key must be bytes or None, got {type(raw_key).__name__}")
    if hashlib.sha256(raw_key).digest() != key:
        raise ValueError("raw_key does not hash to key")
