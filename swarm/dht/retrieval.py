"""Finding values (Kademlia §2.3 FIND_VALUE), and caching what was found on the way.

A get answers from local records when any value will do (from a copy cached on an earlier lookup
only for `cache_max_age` seconds after that lookup, so that subkeys other writers add to a
dictionary reach readers that are not its replicas); otherwise it looks each key up until a
valid value turns up (asking the nearest node first and the others only if it is slow or lacks
the value: a hedged request), or, for the freshest value (`latest=True`), until the k nearest
nodes have answered, and merges their values. Every value found on the network is checked with
the node's validators, since any node may lie. Found values are cached locally and at the
nearest node that answered without them (§2.3 caching), which also repairs replicas that held
an older value.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence

from swarm.core.errors import ValidationError
from swarm.core.timeutil import get_dht_time
from swarm.dht.batching import chunks
from swarm.dht.buckets import NodeInfo
from swarm.dht.context import NodeContext
from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.ids import DHTID
from swarm.dht.keys import deserialize_key
from swarm.dht.storage import merge
from swarm.dht.traversal import LookupResult, Traversal
from swarm.dht.validation import DHTRecord
from swarm.dht.wire import FindAnswer, store_item
from swarm.proto import dht_pb2

logger = logging.getLogger(__name__)


class _Get:
    __slots__ = ("fallback", "first_holder", "found", "holders", "key", "raw_key")

    def __init__(
        self, raw_key: bytes, key: bytes, found: ValueWithExpiration | None, fallback: ValueWithExpiration | None = None
    ) -> None:
        self.raw_key = raw_key
        self.key = key
        self.found = found
        self.fallback = fallback  # a cached copy past cache_max_age: the answer if the lookup finds nothing
        self.holders: dict[DHTID, float] = {}  # node -> expiration of the value it returned
        self.first_holder: DHTID | None = None



_CLOCK_SLACK = 60.0
"""Seconds by which another node's clock may run ahead of this one's (expiration horizons)."""


def _user_key(raw_key: bytes) -> bytes | str | None:
    try:
        return deserialize_key(raw_key)
    except ValueError:
        return None


class Retriever:
    """Runs a node's gets (see the module docstring)."""

    def __init__(self, node: NodeContext) -> None:
        self.node = node
        self.config = node.config
        self.protocol = node.protocol
        self.storage = node.storage
        self.cache = node.cache
        self.stats = node.stats
        self.validator = node.validator

    async def get_many(
        self,
        raw_keys: Sequence[bytes],
        *,
        latest: bool = False,
        timeout: float | None = None,
        on_result: Callable[[bytes, ValueWithExpiration | None], None] | None = None,
    ) -> dict[bytes, ValueWithExpiration | None]:
        """Finds the values of keys given by their serialized form (`swarm.dht.keys.serialize_key`).

        Args:
            raw_keys: Serialized keys.
            latest: Find the value that expires last, asking the k nodes nearest to each key,
                instead of the first valid value (which may come from this node's records).
            timeout: Deadline of the whole operation (default `lookup_timeout`).
            on_result: Called with (raw_key, value) as soon as each key's lookup ends.

        Returns:
            For each key, its value (bytes, or a `DictionaryValue`, still signed) and expiration
            time, or None if no node had a valid one.
        """
        results: dict[bytes, ValueWithExpiration | None] = {}
        gets: dict[DHTID, _Get] = {}
        for raw_key in dict.fromkeys(raw_keys):
            key = hashlib.sha256(raw_key).digest()
            local = self.storage.get(key)
            cached = stale = None
            if self.cache is not None and latest:  # a latest get merges every copy it sees, cached ones included
                cached = self.cache.get(key)
            elif self.cache is not None:
                cached = self.cache.get_fresh(key, self.config.cache_max_age)
                if cached is None:
                    stale = self.cache.get(key)  # too old to answer alone (another writer may have added subkeys)
            local = merge(local, cached)
            if local is not None and not latest:
                local = merge(local, stale)
                results[raw_key] = local
                if on_result is not None:
                    on_result(raw_key, local)
                continue
            gets[DHTID.from_bytes(key)] = _Get(raw_key, key, local, fallback=stale)
        if not gets:
            return results
        beam = self.config.bucket_size if latest else self.config.num_replicas
        traversal: Traversal

        async def ask(node: NodeInfo, keys: list[DHTID]) -> dict[DHTID, list[NodeInfo]] | None:
            answers: dict[DHTID, FindAnswer] = {}
            while keys:  # a node holds back values past its answer's size budget: ask again for them
                more = await self.protocol.call_find(node, keys, values_suffice=not latest, count=beam)
                if more is None:
                    return None
                answers.update(more)
                omitted = [key_id for key_id, answer in more.items() if answer.omitted]
                keys = omitted if len(omitted) < len(keys) else []  # every answer carries one value at least
            for key_id, answer in answers.items():
                get = gets[key_id]
                if answer.value is None or (get.found is not None and not latest):
                    continue  # nothing here, or any value will do and one was found already
                value = self._checked(get, answer.value, node)
                if value is None:
                    continue
                get.found = merge(get.found, value)
                get.holders[node.node_id] = value.expiration_time
                if get.first_holder is None:
                    get.first_holder = node.node_id
                if not latest:
                    traversal.finish(key_id)
            return {key_id: answer.nearest for key_id, answer in answers.items()}

        def finished(done: list[tuple[DHTID, LookupResult]]) -> None:
            for key_id, result in done:
                get = gets[key_id]
                hops = result.hops if get.first_holder is None else traversal.hops_of(get.first_holder)
                self.stats.record(hops, result.requests, found=get.found is not None, timed_out=result.timed_out)
                results[get.raw_key] = found = merge(get.found, get.fallback)
                if on_result is not None:
                    on_result(get.raw_key, found)

        # any valid value will do: ask the nearest node first, and the others only if it is slow
        # to answer (three typical round trips) or lacks the value
        hedge = None if latest else min(3 * self.protocol.round_trip, self.config.request_timeout / 2)
        traversal = self.node.lookup(list(gets), ask, beam, finished, hedge_after=hedge)
        lookups = await traversal.run(self.config.lookup_timeout if timeout is None else timeout)
        self._cache_found(gets, lookups)
        return results

    def _checked(self, get: _Get, found: ValueWithExpiration, node: NodeInfo) -> ValueWithExpiration | None:
        """`found` without what is expired or fails validation (another node may lie); None, and
        `node` distrusted, if it expires further ahead than any node accepts (a forged record)."""
        now = get_dht_time()
        if found.expiration_time <= now:
            return None
        horizon = self.config.expiration_horizon(_user_key(get.raw_key) if self.config.expiration_horizons else None)
        latest = found.expiration_time
        if isinstance(found.value, DictionaryValue):
            latest = max((entry.expiration_time for _, entry in found.value.items()), default=latest)
        if latest > now + horizon + _CLOCK_SLACK:
            self.protocol.distrust(node, f"it sent a record expiring {latest - now:.3g} s ahead")
            return None
        if not isinstance(found.value, DictionaryValue):
            try:
                self.validator.validate(DHTRecord(get.key, b"", found.value, found.expiration_time, get.raw_key))
            except ValidationError as e:
                logger.debug("dropped an invalid value found on the DHT: %s", e)
                return None
            return found
        valid = DictionaryValue()
        for subkey, (value, expiration_time) in found.value.items():
            if expiration_time <= now:
                continue
            try:
                self.validator.validate(DHTRecord(get.key, subkey, value, expiration_time, get.raw_key))
            except ValidationError as e:
                logger.debug("dropped an invalid subkey found on the DHT: %s", e)
                continue
            valid.store(subkey, value, expiration_time)
        return ValueWithExpiration(valid, valid.latest_expiration_time) if len(valid) else None

    def _cache_found(self, gets: dict[DHTID, _Get], lookups: dict[DHTID, LookupResult]) -> None:
        """§2.3 caching: keep found values here, and give them to the nearest node that lacked them."""
        batches: dict[DHTID, tuple[NodeInfo, list[dht_pb2.DHTStoreItem]]] = {}
        for key_id, get in gets.items():
            found = get.found
            if found is None or not get.holders:
                continue  # nothing found, or found only here
            if self.cache is not None:
                if isinstance(found.value, DictionaryValue):
                    self.cache.store_dictionary(get.key, found.value, get.raw_key)
                else:
                    self.cache.store(get.key, found.value, found.expiration_time, None, get.raw_key)
                self.cache.mark_received(get.key, get.raw_key)  # fetched now, even if nothing was new
            if not self.config.cache_nearest:
                continue
            lacking = [
                node for node in lookups[key_id].nearest
                if get.holders.get(node.node_id, float("-inf")) < found.expiration_time
            ][: self.config.cache_nearest]
            if not lacking:
                continue
            if isinstance(found.value, DictionaryValue):
                records = [DHTRecord(get.key, sk, v, e, get.raw_key) for sk, (v, e) in found.value.items()]
            else:
                records = [DHTRecord(get.key, b"", found.value, found.expiration_time, get.raw_key)]
            items = [store_item(record, in_cache=True) for record in records]
            for node in lacking:
                batch = batches.get(node.node_id)
                if batch is None:
                    batch = batches[node.node_id] = (node, [])
                batch[1].extend(items)
        for node, items in batches.values():
            for chunk in chunks(items, [len(item.value) for item in items], self.config.max_keys_per_call):
                if not self.node.closed:
                    self.node.spawn(self.protocol.call_store(node, chunk), f"dht-cache-{node.peer_id[-8:]}")
