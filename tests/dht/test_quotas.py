"""Tests for the storage quotas of swarm.dht.storage and the bounded Find answers of swarm.dht.handlers
(pure logic, no sockets): what one writer can make a node hold, and that a stuffed key stays readable."""

from __future__ import annotations

import pytest

from swarm.dht.handlers import _pack_within
from swarm.dht.keys import key_to_bytes, serialize_subkey
from swarm.dht.storage import DHTLocalStorage, DictionaryValue, StorageQuota

KEY = key_to_bytes("key")
MIB = 1 << 20


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_one_writer_is_held_to_its_bytes_and_records_and_others_still_store() -> None:
    storage = DHTLocalStorage(clock=FakeClock(), quota=StorageQuota(max_writer_bytes=3 * MIB, max_writer_records=5))
    stored = [storage.store(key_to_bytes(f"k{i}"), bytes(MIB), 200.0, writer="mallory") for i in range(6)]
    assert stored == [True, True, False, False, False, False]
    assert "limit per writer" in storage.last_refusal
    assert storage.store(key_to_bytes("honest"), b"v", 200.0, writer="alice")
    assert storage.store(key_to_bytes("k0"), b"small", 300.0, writer="mallory")  # replacing frees its bytes
    assert storage.store(key_to_bytes("k9"), bytes(MIB), 200.0, writer="mallory")
    small = [storage.store(key_to_bytes(f"s{i}"), b"x", 200.0, writer="mallory") for i in range(4)]
    assert small == [True, True, False, False]  # 5 records at most
    assert "records" in storage.last_refusal


def test_a_key_is_held_to_its_bytes_and_subkeys_and_expired_subkeys_free_them() -> None:
    clock = FakeClock()
    storage = DHTLocalStorage(clock=clock, quota=StorageQuota(max_key_bytes=2 * MIB + 1000, max_subkeys=4))
    assert storage.store(KEY, bytes(MIB), 150.0, serialize_subkey(0))
    assert storage.store(KEY, bytes(MIB), 150.0, serialize_subkey(1))
    assert not storage.store(KEY, bytes(MIB), 300.0, serialize_subkey(2))
    assert "limit per key" in storage.last_refusal
    assert storage.store(KEY, b"a", 300.0, serialize_subkey(3))
    assert storage.store(KEY, b"b", 300.0, serialize_subkey(4))
    assert not storage.store(KEY, b"c", 300.0, serialize_subkey(5))
    assert "subkeys" in storage.last_refusal
    clock.now = 160.0  # the two big subkeys expired
    assert storage.store(KEY, bytes(MIB), 300.0, serialize_subkey(2))
    assert storage.store(KEY, b"c", 300.0, serialize_subkey(5))
    assert len(storage.get(KEY).value) == 4


def test_the_node_total_is_bounded_and_expired_records_are_not_counted() -> None:
    clock = FakeClock()
    storage = DHTLocalStorage(clock=clock, quota=StorageQuota(max_bytes=2 * MIB + 1000))
    assert storage.store(key_to_bytes("a"), bytes(MIB), 150.0, writer="w1")
    assert storage.store(key_to_bytes("b"), bytes(MIB), 300.0, writer="w2")
    assert not storage.store(key_to_bytes("c"), bytes(MIB), 300.0, writer="w3")
    assert "the node holds" in storage.last_refusal
    clock.now = 151.0
    assert storage.store(key_to_bytes("c"), bytes(MIB), 300.0, writer="w3")
    storage.remove_outdated()
    assert storage.nbytes == 2 * (MIB + 64)


def test_a_plain_value_that_replaces_a_dictionary_releases_every_subkey() -> None:
    storage = DHTLocalStorage(clock=FakeClock(), quota=StorageQuota(max_writer_records=3))
    for subkey in range(3):
        assert storage.store(KEY, b"v", 200.0, serialize_subkey(subkey), writer="w")
    assert storage.store(KEY, b"plain", 300.0, writer="w")
    assert storage.store(key_to_bytes("other"), b"v", 200.0, writer="w")
    assert storage.store(key_to_bytes("third"), b"v", 200.0, writer="w")


def test_a_stuffed_dictionary_answers_with_its_small_entries_within_the_budget() -> None:
    junk = [(serialize_subkey(f"junk{i}"), bytes(MIB), 1e9) for i in range(10)]
    small = [(serialize_subkey(i), b"declaration", 200.0) for i in range(50)]
    packed = _pack_within(DictionaryValue(junk + small), 4 * MIB)
    assert packed is not None and len(packed) <= 4 * MIB
    answer = DictionaryValue.unpackb(packed)
    assert all(answer.get(subkey) is not None for subkey, _, _ in small)
    assert 0 < sum(answer.get(subkey) is not None for subkey, _, _ in junk) < 4
    whole = DictionaryValue(small)
    assert _pack_within(whole, 4 * MIB) == whole.packb()
    assert _pack_within(DictionaryValue(junk[:1]), 1000) is None


def test_quota_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_subkeys"):
        StorageQuota(max_subkeys=0)
