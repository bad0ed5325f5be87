"""Kademlia identifiers: 256-bit node IDs and key IDs, and the XOR distance between them.

Pure data, no networking. Section numbers in comments refer to Maymounkov & Mazières,
"Kademlia: A Peer-to-peer Information System Based on the XOR Metric" (IPTPS 2002).
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

from swarm.core.identity import peer_id_to_bytes
from swarm.dht.keys import Key, key_to_bytes

if TYPE_CHECKING:
    from typing import Self

ID_BITS = 256
"""Width of a DHTID: node IDs and keys are sha256 digests."""
ID_BYTES = ID_BITS // 8
ID_SPACE = 1 << ID_BITS
"""Number of possible IDs: every DHTID lies in [0, ID_SPACE)."""


class DHTID(int):
    """A 256-bit Kademlia identifier for a node or a key (§2: "160-bit" there, sha256 here)."""

    MIN = 0
    MAX = ID_SPACE  # exclusive

    def __new__(cls, value: int) -> Self:
        if not 0 <= value < ID_SPACE:
            raise ValueError(f"a DHTID is in [0, 2**{ID_BITS}), got {value}")
        return super().__new__(cls, value)

    @classmethod
    def from_peer_id(cls, peer_id: str) -> DHTID:
        """The node ID of a peer: sha256 of its binary PeerID (the multihash)."""
        return cls(int.from_bytes(hashlib.sha256(peer_id_to_bytes(peer_id)).digest(), "big"))

    @classmethod
    def from_key(cls, key: Key) -> DHTID:
        """The ID of a data key: sha256 of the key's msgpack form (`swarm.dht.keys`)."""
        return cls(int.from_bytes(key_to_bytes(key), "big"))

    @classmethod
    def generate(cls, lower: int = 0, upper: int = ID_SPACE, rng: random.Random | None = None) -> DHTID:
        """A uniformly random ID in [lower, upper) (random node IDs, bucket refresh)."""
        if not 0 <= lower < upper <= ID_SPACE:
            raise ValueError(f"empty or out-of-space range [{lower}, {upper})")
        return cls((rng or random).randrange(lower, upper))

    def to_bytes(  # type: ignore[override]
        self, length: int = ID_BYTES, byteorder: str = "big", *, signed: bool = False
    ) -> bytes:
        """The 32-byte big-endian form used on the wire and as a storage key."""
        return int(self).to_bytes(length, byteorder, signed=signed)  # type: ignore[arg-type]

    @classmethod
    def from_bytes(  # type: ignore[override]
        cls, raw: bytes, byteorder: str = "big", *, signed: bool = False
    ) -> DHTID:
        """Parses `to_bytes` output.

        Raises:
            ValueError: `raw` is not exactly 32 bytes.
        """
        if len(raw) != ID_BYTES:
            raise ValueError(f"a DHTID is {ID_BYTES} bytes, got {len(raw)}")
        return cls(int.from_bytes(raw, byteorder, signed=signed))  # type: ignore[arg-type]

    def xor_distance(self, other: int) -> int:
        """Kademlia's distance d(x, y) = x XOR y (§2.1)."""
        return int(self) ^ int(other)

    def __repr__(self) -> str:
        return f"DHTID({int(self):#066x})"


def xor_distance(a: int, b: int) -> int:
    """Kademlia's distance d(a, b) = a XOR b (§2.1): symmetric, and unidirectional."""
    return int(a) ^ int(b)
