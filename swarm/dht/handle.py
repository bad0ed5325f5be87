"""What the layers above the DHT need of it (`KeyValueStore`) and of their peer (`PeerHandle`).

Averaging, mixture-of-experts and the optimizer take a `PeerHandle`: the peer's network side
(`swarm.net.handle.NetworkHandle`) plus its DHT, typed as the key-value store they use.
`swarm.dht.DHT` implements `KeyValueStore`; `swarm.Peer` implements `PeerHandle`.
See docs/architecture.md for the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from swarm.dht.buckets import NodeInfo
from swarm.dht.expiring import ValueWithExpiration
from swarm.dht.keys import Key, Subkey
from swarm.net.handle import NetworkHandle


class KeyValueStore(Protocol):
    """The DHT as a store of expiring, optionally dictionary-valued records.

    Every awaitable method runs on the peer's loop; the blocking forms (no ``a`` prefix) are for
    other threads. A dictionary value (stored with subkeys) comes back as a
    `ValueWithExpiration` whose value maps each subkey to its own `ValueWithExpiration`.
    """

    @property
    def peer_id(self) -> str:
        """The PeerID of the peer this store writes as (the owner of its self-records)."""
        ...

    async def astore(self, key: Key, value: object, expiration_time: float, subkey: Subkey | None = None) -> bool:
        """Stores `value` under `key` (and `subkey`) until `expiration_time`; True if a replica took it."""
        ...

    async def aget(self, key: Key, latest: bool = False) -> ValueWithExpiration | None:
        """The value under `key`, or None; with `latest`, the freshest the replicas hold."""
        ...

    def read_patience(self) -> float:
        """Seconds another peer's read may still spend waiting on nodes this one saw time out
        (one request timeout for a minute after this peer's last call that timed out, else 0):
        this peer's own reads no longer wait for them (`swarm.dht.traversal`), a peer that has
        not met them yet does."""
        ...

    async def astore_many(
        self,
        keys: Sequence[Key],
        values: Sequence[object],
        expiration_time: float | Sequence[float],
        subkeys: Sequence[Subkey | None] | None = None,
    ) -> list[bool]:
        """Stores many records in one batched operation (raises `ValidationError` naming refusals)."""
        ...

    async def aget_many(self, keys: Sequence[Key], latest: bool = False) -> dict[Key, ValueWithExpiration | None]:
        """The values of many keys in one batched lookup."""
        ...

    async def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Waits until the replicas of earlier stores have answered; True if none is left in flight."""
        ...

    def holds_replica(self, key: Key) -> bool:
        """Whether this node is one of `key`'s replicas, which every writer's store reaches (on the
        peer's loop)."""
        ...

    def local_copy(self, key: Key) -> ValueWithExpiration | None:
        """This node's own stored copy of `key`'s value, or None; no request is sent (on the
        peer's loop)."""
        ...

    def watch_local(self, key: Key, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback()` on the peer's loop whenever a store changes this node's copy of
        `key`; returns the function that stops it."""
        ...

    def store(self, key: Key, value: object, expiration_time: float, subkey: Subkey | None = None) -> bool: ...

    def get(self, key: Key, latest: bool = False) -> ValueWithExpiration | None: ...

    def known_peers(self) -> list[NodeInfo]:
        """The nodes of this node's routing table (peer ID and address of each)."""
        ...


class PeerHandle(NetworkHandle, Protocol):
    """A peer as averaging, mixture-of-experts and the optimizer see it."""

    @property
    def dht(self) -> KeyValueStore | None:
        """The peer's DHT; None only for peers built without one (tests of the layers below)."""
        ...

    @property
    def role(self) -> str: ...

    served_experts: list[str]
    """The expert UIDs this peer serves, reported by its ``Info`` RPC (set by an `ExpertServer`)."""
