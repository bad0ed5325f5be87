"""`DHT`: the DHT as a peer's user sees it, `peer.dht` (docs/architecture.md).

User keys are strings (or bytes), values anything msgpack can carry. The facade turns them into
signed, validated records (`validation.py`), hands them to the node (`node.py`) and turns what
comes back into `ValueWithExpiration` again, signatures stripped and values deserialized.

Every method has a blocking form, which runs on the peer's event loop through `peer.run`, and
an awaitable one prefixed with `a`, for code inside an event loop. Single stores and gets made
concurrently are coalesced: those issued in the same loop iteration travel as one batched
lookup, and each returns as soon as its own key is settled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TypeVar

from swarm.core.errors import ConfigError, ValidationError
from swarm.core.serialization import pack, unpack
from swarm.core.timeutil import get_dht_time
from swarm.dht.buckets import NodeInfo
from swarm.dht.coalescer import Coalescer
from swarm.dht.config import DHTConfig
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.keys import (
    Key,
    Subkey,
    deserialize_subkey,
    hash_serialized_key,
    serialize_key,
    serialize_subkey,
)
from swarm.dht.node import DHTNode
from swarm.dht.store_outcome import StoreOutcome
from swarm.dht.validation import CompositeValidator, DHTRecord, SignatureValidator
from swarm.net.handle import NetworkHandle

logger = logging.getLogger(__name__)

T = TypeVar("T")

PATIENCE_AFTER_TIMEOUT = 60.0
"""Seconds after this peer's last DHT call that timed out during which others' reads may still
wait on that node (`DHT.read_patience`)."""


class DHT:
    """A peer's view of the DHT: `peer.dht`. Create it with `await DHT.create(peer, config)`.

    Example:
        peer.dht.store("run1_progress", {"step": 5}, get_dht_time() + 60)
        found = peer.dht.get("run1_progress")   # ValueWithExpiration({"step": 5}, ...)
    """

    def __init__(self, peer: NetworkHandle, node: DHTNode, validator: CompositeValidator, config: DHTConfig) -> None:
        self.peer = peer
        self.node = node
        self.validator = validator
        self.config = config
        self._stores: Coalescer[DHTRecord, StoreOutcome] = Coalescer(self._store_batch, "dht-store-batch")
        self._gets = {
            latest: Coalescer[bytes, ValueWithExpiration | None](self._get_batch(latest), "dht-get-batch")
            for latest in (False, True)
        }

    @classmethod
    async def create(cls, peer: NetworkHandle, config: DHTConfig | None = None) -> DHT:
        """Starts the peer's DHT node and joins through `peer.initial_peers`.

        Raises:
            DHTError: Initial peers were given and none of them answered.
        """
        config = DHTConfig() if config is None else config
        if not isinstance(config, DHTConfig):
            raise ConfigError(f"dht_config must be a DHTConfig, got {type(config).__name__}")
        validator = CompositeValidator([SignatureValidator(peer.identity), *config.validators])
        node = await DHTNode.create(
            peer_id=peer.peer_id, addrs=peer.addrs, pool=peer.pool, server=peer.server, config=config,
            validator=validator, initial_peers=peer.initial_peers,
        )
        return cls(peer, node, validator, config)

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    async def ashutdown(self) -> None:
        """Leaves the DHT: stops background work (the peer calls this at shutdown)."""
        await self._stores.close()
        for coalescer in self._gets.values():
            await coalescer.close()
        await self.node.shutdown()

    def _run(self, coro: Coroutine[object, None, T]) -> T:
        return self.peer.run(coro, timeout=self.config.lookup_timeout + 2 * self.config.request_timeout + 5)

    async def _in_loop(self, coro: Coroutine[object, None, T]) -> T:
        return await self.peer.loop.wrap(coro)

    # -- records ------------------------------------------------------------------------------------

    def _record(self, key: Key, value: object, expiration_time: float, subkey: Subkey | None) -> DHTRecord:
        """The signed record for a user's store; raises if this node's own validators refuse it."""
        if isinstance(expiration_time, bool) or not isinstance(expiration_time, int | float):
            raise TypeError(f"expiration_time must be a number, got {type(expiration_time).__name__}")
        if not math.isfinite(expiration_time):
            raise ValueError(f"expiration_time must be finite, got {expiration_time}")
        raw_key = serialize_key(key)
        serialized_subkey = serialize_subkey(subkey)
        try:
            packed = pack(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"DHT value of key {key!r} cannot be serialized with msgpack: {e}") from e
        record = DHTRecord(hash_serialized_key(raw_key), serialized_subkey, packed, float(expiration_time), raw_key)
        signed = dataclasses.replace(record, value=self.validator.sign_value(record))
        self.validator.validate(signed)
        if len(signed.value) > self.config.max_value_bytes:
            raise ValueError(
                f"DHT value of key {key!r} is {len(signed.value)} bytes serialized; "
                f"the limit is {self.config.max_value_bytes}"
            )
        return signed

    @staticmethod
    def _verdict(key: Key, outcome: StoreOutcome) -> bool:
        """True if stored; raises if other nodes refused the record and none of them took it."""
        if outcome.rejected and outcome.stored == int(outcome.kept_here):
            raise ValidationError(f"store of key {key!r} was refused: {'; '.join(outcome.rejected[:3])}")
        return outcome.stored > 0

    def _decode(self, key: bytes, raw_key: bytes, found: ValueWithExpiration | None) -> ValueWithExpiration | None:
        if found is None:
            return None
        if not isinstance(found.value, DictionaryValue):
            record = DHTRecord(key, b"", found.value, found.expiration_time, raw_key)
            try:
                return ValueWithExpiration(unpack(self.validator.strip_value(record)), found.expiration_time)
            except (ValueError, TypeError) as e:
                logger.debug("dropped an undecodable DHT value: %s", e)
                return None
        values: dict[object, ValueWithExpiration] = {}
        for subkey, (value, expiration_time) in found.value.items():
            record = DHTRecord(key, subkey, value, expiration_time, raw_key)
            try:
                values[deserialize_subkey(subkey)] = ValueWithExpiration(
                    unpack(self.validator.strip_value(record)), expiration_time
                )
            except (ValueError, TypeError) as e:
                logger.debug("dropped an undecodable DHT subkey: %s", e)
        return ValueWithExpiration(values, found.expiration_time) if values else None

    # -- batches ------------------------------------------------------------------------------------

    async def _store_batch(self, records: list[DHTRecord], deliver: Callable[[int, StoreOutcome], None]) -> None:
        await self.node.store_many(records, on_result=deliver)

    def _get_batch(self, latest: bool) -> Callable[[list[bytes], Callable[[int, ValueWithExpiration | None], None]], Awaitable[None]]:
        async def run(raw_keys: list[bytes], deliver: Callable[[int, ValueWithExpiration | None], None]) -> None:
            positions: dict[bytes, list[int]] = {}
            for index, raw_key in enumerate(raw_keys):
                positions.setdefault(raw_key, []).append(index)

            def on_result(raw_key: bytes, found: ValueWithExpiration | None) -> None:
                for index in positions.get(raw_key, ()):
                    deliver(index, found)

            await self.node.get_many(raw_keys, latest=latest, on_result=on_result)

        return run

    # -- awaitable API ------------------------------------------------------------------------------

    async def astore(self, key: Key, value: object, expiration_time: float, subkey: Subkey | None = None) -> bool:
        """Stores `value` under `key` (and `subkey`) until `expiration_time` (seconds since the epoch).

        A store with a later expiration replaces an earlier one; with a subkey, the key holds a
        dictionary whose subkeys expire each on its own.

        Returns:
            True if at least one node stored it; False if it has expired, every node already
            held a value expiring as late or later, or no node answered.

        Raises:
            ValidationError: This node's validators refuse the record (for example, a key owned
                by another peer), or other nodes refused it and none took it (their reasons are
                in the message).
            TypeError, ValueError: The key, subkey, value or expiration time is unusable.
        """
        record = self._record(key, value, expiration_time, subkey)
        if record.expiration_time <= get_dht_time():
            return False
        return await self._in_loop(self._store_one(key, record))

    async def _store_one(self, key: Key, record: DHTRecord) -> bool:
        return self._verdict(key, await self._stores.submit(record))

    async def aget(self, key: Key, latest: bool = False) -> ValueWithExpiration | None:
        """The value stored under `key`, or None.

        Args:
            key: The key.
            latest: Find the value that expires last (ask the k nodes nearest to the key) rather
                than the first valid one, which may come from this node's cache.

        Returns:
            `ValueWithExpiration(value, expiration_time)`; for a dictionary, `value` maps each
            subkey to its own `ValueWithExpiration`. None if no valid, unexpired value exists.
        """
        raw_key = serialize_key(key)
        return await self._in_loop(self._get_one(raw_key, latest))

    async def _get_one(self, raw_key: bytes, latest: bool) -> ValueWithExpiration | None:
        found = await self._gets[latest].submit(raw_key)
        return self._decode(hashlib.sha256(raw_key).digest(), raw_key, found)

    def holds_replica(self, key: Key) -> bool:
        """Whether this node is one of `key`'s replicas, the nodes every writer's store of it
        reaches (`DHTNode.holds_replica`); never in client mode. Call it on the peer's loop."""
        return self.node.holds_replica(hashlib.sha256(serialize_key(key)).digest())

    def local_copy(self, key: Key) -> ValueWithExpiration | None:
        """This node's own stored copy of `key`'s value (its DHT storage, not its cache), decoded
        as `aget` returns it, or None; no request is sent. The records were validated when they
        were stored here. Call it on the peer's loop (`watch_local` callbacks run there)."""
        raw_key = serialize_key(key)
        key_id = hashlib.sha256(raw_key).digest()
        return self._decode(key_id, raw_key, self.node.storage.get(key_id))

    def watch_local(self, key: Key, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback()` on the peer's event loop each time a store changes this node's
        copy of `key` (another peer's store reaching this replica, or this peer's own); returns
        the function that stops it. Call it on the peer's event loop."""
        return self.node.storage.watch(hashlib.sha256(serialize_key(key)).digest(), callback)

    async def astore_many(
        self,
        keys: Sequence[Key],
        values: Sequence[object],
        expiration_time: float | Sequence[float],
        subkeys: Sequence[Subkey | None] | None = None,
    ) -> list[bool]:
        """Stores many values in one batched operation; the result of each, in order.

        `expiration_time` is one time for all, or one per value; `subkeys` one per value.

        Raises:
            ValidationError: Some records were refused (by this node before anything was sent, or
                by every node that answered); the message names them and why.
        """
        count = len(keys)
        times = [expiration_time] * count if isinstance(expiration_time, int | float) else list(expiration_time)
        subs = [None] * count if subkeys is None else list(subkeys)
        if not len(values) == len(times) == len(subs) == count:
            raise ValueError("keys, values, expiration times and subkeys must have the same length")
        records = [self._record(k, v, t, s) for k, v, t, s in zip(keys, values, times, subs)]
        outcomes = await self._in_loop(self.node.store_many(records))
        results, refused = [], []
        for key, outcome in zip(keys, outcomes):
            try:
                results.append(self._verdict(key, outcome))
            except ValidationError as e:
                results.append(False)
                refused.append(str(e))
        if refused:
            raise ValidationError(f"{len(refused)} of {count} records were refused: {' | '.join(refused[:5])}", results)
        return results

    async def aget_many(self, keys: Sequence[Key], latest: bool = False) -> dict[Key, ValueWithExpiration | None]:
        """The values of many keys, found in one batched lookup (None for keys without one)."""
        raw_keys = {key: serialize_key(key) for key in keys}
        found = await self._in_loop(self.node.get_many(list(raw_keys.values()), latest=latest))
        return {key: self._decode(hashlib.sha256(raw).digest(), raw, found.get(raw)) for key, raw in raw_keys.items()}

    def read_patience(self) -> float:
        """See `swarm.dht.handle.KeyValueStore.read_patience`."""
        # Peers that look up the same keys meet the same dead nodes together, round by round, so
        # a timeout long past says nothing of the next read; a stale suspect must not stretch
        # every leader's wait in a long-lived swarm.
        recent = self.node.protocol.contacts.timed_out_within(PATIENCE_AFTER_TIMEOUT)
        return self.config.request_timeout if recent else 0.0

    async def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Waits until the stores made so far have reached every replica (a store returns once
        the nearest holds the record; the others are written in the background).

        Returns:
            True if no store is left in flight (False: `timeout` passed first).
        """
        return await self._in_loop(self.node.wait_for_stores(timeout))

    def known_peers(self) -> list[NodeInfo]:
        """The nodes of this node's routing table that have an address (peer ID and address of each)."""
        return [node for node in self.node.routing_table if node.addr]

    # -- blocking API -------------------------------------------------------------------------------

    def store(self, key: Key, value: object, expiration_time: float, subkey: Subkey | None = None) -> bool:
        """Blocking form of `astore`."""
        return self._run(self.astore(key, value, expiration_time, subkey))

    def get(self, key: Key, latest: bool = False) -> ValueWithExpiration | None:
        """Blocking form of `aget`."""
        return self._run(self.aget(key, latest))

    def store_many(
        self,
        keys: Sequence[Key],
        values: Sequence[object],
        expiration_time: float | Sequence[float],
        subkeys: Sequence[Subkey | None] | None = None,
    ) -> list[bool]:
        """Blocking form of `astore_many`."""
        return self._run(self.astore_many(keys, values, expiration_time, subkeys))

    def get_many(self, keys: Sequence[Key], latest: bool = False) -> dict[Key, ValueWithExpiration | None]:
        """Blocking form of `aget_many`."""
        return self._run(self.aget_many(keys, latest))

    def __repr__(self) -> str:
        mode = "client" if self.node.client_mode else "full"
        return f"DHT({self.peer_id}, {mode}, contacts={len(self.node.routing_table)}, records={len(self.node.storage)})"

