"""Tests for swarm.dht.storage: expiration, replace rules, dictionaries, eviction, merging."""

from __future__ import annotations

import msgpack
import pytest

from swarm.dht.dictionary_value import DictionaryValue
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.keys import key_to_bytes, serialize_subkey
from swarm.dht.storage import CacheStorage, DHTLocalStorage, latest, merge, merge_all

KEY = key_to_bytes("key")
OTHER = key_to_bytes("other")
SUB_A = serialize_subkey("a")
SUB_B = serialize_subkey("b")


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def storage(clock: FakeClock) -> DHTLocalStorage:
    return DHTLocalStorage(clock=clock)


def subkeys(result: ValueWithExpiration | None) -> dict[bytes, tuple[bytes, float]]:
    assert result is not None and isinstance(result.value, DictionaryValue)
    return {k: (v.value, v.expiration_time) for k, v in result.value.items()}


# --- plain values ------------------------------------------------------------------------


def test_later_expiration_replaces_earlier_and_not_the_reverse(storage: DHTLocalStorage) -> None:
    assert storage.store(KEY, b"v1", 200.0)
    assert storage.get(KEY) == ValueWithExpiration(b"v1", 200.0)
    assert storage.store(KEY, b"v2", 300.0)
    assert storage.get(KEY) == (b"v2", 300.0)
    assert not storage.store(KEY, b"v3", 250.0)  # earlier: refused, old kept
    assert not storage.store(KEY, b"v4", 300.0)  # equal: refused, old kept
    assert storage.get(KEY) == (b"v2", 300.0)
    assert storage.get(OTHER) is None


def test_expired_values_vanish_and_are_not_stored(storage: DHTLocalStorage, clock: FakeClock) -> None:
    assert not storage.store(KEY, b"v", 100.0)  # expires now: refused
    assert not storage.store(KEY, b"v", 50.0)
    assert storage.store(KEY, b"v", 150.0)
    clock.now = 150.0
    assert storage.get(KEY) is None
    assert KEY not in storage and len(storage) == 0
    assert storage.store(KEY, b"new", 160.0)  # an expired record does not block a new one
    assert storage.get(KEY) == (b"new", 160.0)


def test_remove_outdated_purges_with_the_heap(storage: DHTLocalStorage, clock: FakeClock) -> None:
    for i in range(100):
        storage.store(key_to_bytes(i.to_bytes(2, "big")), b"v", 101.0 + i)
    storage.store(KEY, b"v", 1000.0)
    storage.store(KEY, b"v", 2000.0)  # the stale heap entry for 1000.0 must not purge it
    clock.now = 150.5
    storage.remove_outdated()
    assert len(storage) == 51
    clock.now = 1500.0
    storage.remove_outdated()
    assert len(storage) == 1 and storage.get(KEY) == (b"v", 2000.0)


def test_heap_does_not_grow_without_bound_under_updates(storage: DHTLocalStorage) -> None:
    for i in range(5000):
        assert storage.store(KEY, b"v", 200.0 + i)
    assert len(storage._heap) < 200


def test_items_lists_live_records(storage: DHTLocalStorage, clock: FakeClock) -> None:
    storage.store(KEY, b"v", 200.0)
    storage.store(OTHER, b"w", 120.0)
    storage.store(key_to_bytes("dict"), b"x", 300.0, subkey=SUB_A)
    clock.now = 130.0
    items = dict(storage.items())
    assert set(items) == {KEY, key_to_bytes("dict")}
    assert items[KEY] == (b"v", 200.0)
    assert subkeys(items[key_to_bytes("dict")]) == {SUB_A: (b"x", 300.0)}


def test_bad_arguments_are_rejected(storage: DHTLocalStorage) -> None:
    with pytest.raises(TypeError):
        storage.store("key", b"v", 200.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        storage.store(KEY, "v", 200.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        storage.store(KEY, b"v", 200.0, subkey="a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        storage.store(KEY, b"v", float("nan"))
    with pytest.raises(ValueError):
        DHTLocalStorage(max_size=0)


# --- dictionaries ------------------------------------------------------------------------


def test_subkeys_merge_each_with_its_own_expiration(storage: DHTLocalStorage, clock: FakeClock) -> None:
    assert storage.store(KEY, b"a1", 200.0, subkey=SUB_A)
    assert storage.store(KEY, b"b1", 300.0, subkey=SUB_B)
    assert not storage.store(KEY, b"a0", 150.0, subkey=SUB_A)  # older subkey value refused
    assert storage.store(KEY, b"a2", 250.0, subkey=SUB_A)
    result = storage.get(KEY)
    assert result.expiration_time == 300.0  # the record expires with its latest subkey
    assert subkeys(result) == {SUB_A: (b"a2", 250.0), SUB_B: (b"b1", 300.0)}
    clock.now = 260.0
    assert subkeys(storage.get(KEY)) == {SUB_B: (b"b1", 300.0)}  # expired subkey gone
    clock.now = 300.0
    assert storage.get(KEY) is None


def test_get_returns_a_copy(storage: DHTLocalStorage) -> None:
    storage.store(KEY, b"a", 200.0, subkey=SUB_A)
    result = storage.get(KEY)
    result.value.store(SUB_B, b"intruder", 500.0)
    assert subkeys(storage.get(KEY)) == {SUB_A: (b"a", 200.0)}


def test_plain_value_replaces_dictionary_only_if_later_than_every_subkey(storage: DHTLocalStorage) -> None:
    storage.store(KEY, b"a", 200.0, subkey=SUB_A)
    storage.store(KEY, b"b", 300.0, subkey=SUB_B)
    assert not storage.store(KEY, b"plain", 250.0)  # later than a, not than b
    assert not storage.store(KEY, b"plain", 300.0)  # a tie keeps what is stored
    assert storage.store(KEY, b"plain", 301.0)
    assert storage.get(KEY) == (b"plain", 301.0)


def test_subkey_replaces_plain_value_only_if_later(storage: DHTLocalStorage) -> None:
    storage.store(KEY, b"plain", 300.0)
    assert not storage.store(KEY, b"a", 250.0, subkey=SUB_A)
    assert not storage.store(KEY, b"a", 300.0, subkey=SUB_A)
    assert storage.store(KEY, b"a", 301.0, subkey=SUB_A)
    assert subkeys(storage.get(KEY)) == {SUB_A: (b"a", 301.0)}


def test_store_dictionary_merges_or_replaces_by_overall_expiration(storage: DHTLocalStorage) -> None:
    storage.store(KEY, b"plain", 300.0)
    incoming = DictionaryValue([(SUB_A, b"a", 250.0), (SUB_B, b"b", 290.0)])
    assert not storage.store_dictionary(KEY, incoming)  # whole dictionary expires before 300
    later = DictionaryValue([(SUB_A, b"a", 250.0), (SUB_B, b"b", 350.0)])
    assert storage.store_dictionary(KEY, later)  # replaces the plain value with every subkey
    assert subkeys(storage.get(KEY)) == {SUB_A: (b"a", 250.0), SUB_B: (b"b", 350.0)}
    mixed = DictionaryValue([(SUB_A, b"a2", 260.0), (SUB_B, b"old", 100.5)])
    assert storage.store_dictionary(KEY, mixed)
    assert subkeys(storage.get(KEY)) == {SUB_A: (b"a2", 260.0), SUB_B: (b"b", 350.0)}
    assert not storage.store_dictionary(OTHER, DictionaryValue([(SUB_A, b"x", 50.0)]))  # expired
    assert storage.store_dictionary(OTHER, later)
    assert storage.get(OTHER).expiration_time == 350.0


def test_dictionary_value_serialization_roundtrip() -> None:
    value = DictionaryValue([(SUB_A, b"a", 250.0), (SUB_B, b"b", 350.0)])
    assert DictionaryValue.unpackb(value.packb()) == value
    assert value.latest_expiration_time == 350.0
    assert DictionaryValue().latest_expiration_time == float("-inf")
    for bad in (b"\xc1", b"\x01", DictionaryValue([]).packb() + b"\x00"):
        with pytest.raises(ValueError):
            DictionaryValue.unpackb(bad)
    with pytest.raises(ValueError, match="bad row"):
        DictionaryValue.unpackb(msgpack.packb([[b"a", "not bytes", 1.0]], use_bin_type=True))


# --- size limit and cache ----------------------------------------------------------------


def test_max_size_evicts_the_record_expiring_soonest(clock: FakeClock) -> None:
    storage = DHTLocalStorage(max_size=2, clock=clock)
    keys = [key_to_bytes(name) for name in ("a", "b", "c", "d")]
    storage.store(keys[0], b"a", 200.0)
    storage.store(keys[1], b"b", 300.0)
    assert storage.store(keys[2], b"c", 250.0)  # evicts a (200)
    assert storage.get(keys[0]) is None and len(storage) == 2
    assert not storage.store(keys[3], b"d", 240.0)  # would be the first to go: refused
    assert storage.get(keys[3]) is None
    assert storage.store(keys[1], b"b2", 400.0)  # updating an existing key needs no room
    assert {k for k, _ in storage.items()} == {keys[1], keys[2]}
    clock.now = 260.0  # c expired: room without evicting anything live
    assert storage.store(keys[3], b"d", 270.0)
    assert storage.get(keys[1]) == (b"b2", 400.0)


def test_cache_storage_is_separate_and_bounded(clock: FakeClock) -> None:
    local = DHTLocalStorage(clock=clock)
    cache = CacheStorage(clock=clock)
    assert isinstance(cache, DHTLocalStorage) and cache.max_size is not None
    cache.store(KEY, b"cached", 200.0)
    assert local.get(KEY) is None and cache.get(KEY) == (b"cached", 200.0)


def test_a_cached_record_is_fresh_for_max_age_after_a_store_for_it_last_arrived(clock: FakeClock) -> None:
    cache = CacheStorage(clock=clock)
    assert cache.get_fresh(KEY, 5.0) is None
    cache.store(KEY, b"cached", 200.0)
    clock.now = 104.0
    assert cache.get_fresh(KEY, 5.0) == (b"cached", 200.0)
    clock.now = 105.0
    assert cache.get_fresh(KEY, 5.0) is None and cache.get(KEY) == (b"cached", 200.0)  # stale, still there
    assert not cache.store(KEY, b"cached", 200.0)  # nothing new: a re-fetch marks it received
    cache.mark_received(KEY)
    assert cache.get_fresh(KEY, 5.0) == (b"cached", 200.0)
    assert cache.get_fresh(KEY, 0.0) is None  # max_age 0: never fresh


# --- merging answers from several peers --------------------------------------------------


def test_latest_picks_the_later_expiration() -> None:
    a = ValueWithExpiration(b"a", 100.0)
    b = ValueWithExpiration(b"b", 200.0)
    assert latest(a, b) is b and latest(b, a) is b
    assert latest(a, None) is a and latest(None, a) is a and latest(None, None) is None
    tie = ValueWithExpiration(b"tie", 100.0)
    assert latest(a, tie) is a


def test_merge_combines_dictionaries_per_subkey_without_touching_inputs() -> None:
    first = DictionaryValue([(SUB_A, b"a1", 200.0), (SUB_B, b"b1", 300.0)])
    second = DictionaryValue([(SUB_A, b"a2", 250.0), (SUB_B, b"b0", 100.0)])
    merged = merge(ValueWithExpiration(first, 300.0), ValueWithExpiration(second, 250.0))
    assert subkeys(merged) == {SUB_A: (b"a2", 250.0), SUB_B: (b"b1", 300.0)}
    assert merged.expiration_time == 300.0
    assert first.get(SUB_A) == (b"a1", 200.0)  # inputs unchanged
    plain = ValueWithExpiration(b"plain", 400.0)
    assert merge(ValueWithExpiration(first, 300.0), plain) is plain
    assert merge(plain, ValueWithExpiration(first, 300.0)) is plain
    everything = merge_all(
        [None, ValueWithExpiration(first, 300.0), None, ValueWithExpiration(second, 250.0)]
    )
    assert subkeys(everything) == subkeys(merged)
    assert merge_all([]) is None


# --- original keys and arrival times (replication, republishing) ---------------------------------


def test_storage_keeps_the_original_key_until_the_record_goes(storage: DHTLocalStorage, clock: FakeClock) -> None:
    raw = msgpack.packb("key", use_bin_type=True)
    assert storage.store(KEY, b"v", 200.0, raw_key=raw)
    assert storage.raw_key(KEY) == raw and storage.last_received(KEY) == 100.0
    clock.now = 150.0
    assert storage.store(KEY, b"v2", 300.0)  # a store without it keeps the known one
    assert storage.raw_key(KEY) == raw and storage.last_received(KEY) == 150.0
    clock.now = 300.0
    assert storage.get(KEY) is None
    assert storage.raw_key(KEY) is None and storage.last_received(KEY) is None


def test_raw_key_must_hash_to_the_key(storage: DHTLocalStorage) -> None:
    with pytest.raises(ValueError, match="does not hash"):
        storage.store(KEY, b"v", 200.0, raw_key=b"\xa5other")
    with pytest.raises(TypeError):
        storage.store(KEY, b"v", 200.0, raw_key="key")  # type: ignore[arg-type]


def test_mark_received_records_refused_repeats(storage: DHTLocalStorage, clock: FakeClock) -> None:
    storage.mark_received(KEY)  # nothing stored: nothing to mark
    assert storage.last_received(KEY) is None
    assert storage.store(KEY, b"v", 200.0)
    clock.now = 120.0
    assert not storage.store(KEY, b"v", 200.0)  # the same record again (republished by a peer)
    storage.mark_received(KEY)
    assert storage.last_received(KEY) == 120.0


def test_evicted_and_purged_records_forget_their_original_keys(clock: FakeClock) -> None:
    storage = DHTLocalStorage(max_size=1, clock=clock)
    raw_a, raw_b = msgpack.packb("key", use_bin_type=True), msgpack.packb("other", use_bin_type=True)
    assert storage.store(KEY, b"a", 150.0, raw_key=raw_a)
    assert storage.store(OTHER, b"b", 200.0, raw_key=raw_b)  # evicts KEY
    assert storage.raw_key(KEY) is None and storage.raw_key(OTHER) == raw_b
    clock.now = 250.0
    storage.remove_outdated()
    assert storage.raw_key(OTHER) is None


def test_store_dictionary_keeps_the_original_key(storage: DHTLocalStorage) -> None:
    raw = msgpack.packb("key", use_bin_type=True)
    assert storage.store_dictionary(KEY, DictionaryValue([(SUB_A, b"1", 200.0)]), raw_key=raw)
    assert storage.raw_key(KEY) == raw


def test_a_watcher_hears_of_each_store_that_changes_its_key_and_of_nothing_else(storage: DHTLocalStorage) -> None:
    heard: list[str] = []
    unwatch = storage.watch(KEY, lambda: heard.append("key"))
    assert storage.store(KEY, b"v1", 200.0, SUB_A)
    assert not storage.store(KEY, b"old", 150.0, SUB_A)  # refused: expires earlier than what is held
    assert storage.store(OTHER, b"x", 200.0)  # another key
    assert storage.store_dictionary(KEY, DictionaryValue([(SUB_B, b"w", 210.0)]))
    assert heard == ["key", "key"]
    unwatch()
    unwatch()  # twice is harmless
    assert storage.store(KEY, b"v2", 220.0, SUB_A)
    assert heard == ["key", "key"]


def test_a_failing_watcher_does_not_fail_the_store(storage: DHTLocalStorage) -> None:
    def broken() -> None:
        raise RuntimeError("watcher bug")

    heard: list[int] = []
    storage.watch(KEY, broken)
    storage.watch(KEY, lambda: heard.append(1))
    assert storage.store(KEY, b"v", 200.0)
    assert storage.get(KEY) == ValueWithExpiration(b"v", 200.0)
    assert heard == [1]  # the next watcher still heard of it
