"""Storage quotas per source network: many identities from one network share one quota."""

from __future__ import annotations

from swarm.dht.storage import DHTLocalStorage, StorageQuota


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_identities_from_one_network_share_its_quota_and_others_are_served() -> None:
    storage = DHTLocalStorage(clock=lambda: 0.0, quota=StorageQuota(max_writer_records=10, max_source_records=4))
    stored = [storage.store(_key(i), b"v", 100.0, writer=f"sybil-{i}", source="10.0.0.0/24") for i in range(8)]
    assert stored == [True] * 4 + [False] * 4
    assert storage.last_refusal == "the source network holds 4 records here, the limit per source network"
    assert storage.store(_key(100), b"v", 100.0, writer="honest", source="10.1.0.0/24")
    assert storage.store(_key(101), b"v", 100.0, writer="local")  # no source (loopback): per writer only
    # replacing one's own record needs no new room
    assert storage.store(_key(0), b"w", 200.0, writer="sybil-0", source="10.0.0.0/24")


def test_source_bytes_are_released_when_records_expire() -> None:
    now = [0.0]
    storage = DHTLocalStorage(clock=lambda: now[0], quota=StorageQuota(max_source_bytes=1000))
    assert storage.store(_key(1), b"x" * 800, 10.0, writer="a", source="10.0.0.0/24")
    assert not storage.store(_key(2), b"x" * 800, 10.0, writer="b", source="10.0.0.0/24")
    assert "limit per source network" in (storage.last_refusal or "")
    now[0] = 11.0
    assert storage.store(_key(2), b"x" * 800, 20.0, writer="b", source="10.0.0.0/24")
