"""Peer authentication: every call tells the callee who the caller is, in a way the caller cannot fake.

The caller signs a *ticket* once per callee: (caller public key, callee PeerID, expiry, nonce).
The ticket travels in the metadata of every call; the callee verifies its Ed25519 signature
the first time it sees it and caches the result, so later calls cost one dict lookup instead of
a verification (BENCHMARKS.md, "Transport facts"). Binding the callee's PeerID means a peer that receives a
ticket cannot replay it to anyone else. The callee proves its own PeerID through `Handshake`:
it signs a fresh challenge of the caller's together with both PeerIDs.

By default every connection is TLS 1.3 whose certificate proves the callee's PeerID
(`swarm.net.tls`), so a ticket reaches only the callee it is addressed to, which no other peer
would accept it from: a captured ticket is worthless. With `--insecure` connections are plaintext,
and then this authenticates peers against impostors, not against an on-path attacker who can read
and rewrite packets or replay a ticket to the same callee (docs/security.md).
"""

from __future__ import annotations

import os
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence

from swarm.core.errors import Unauthenticated
from swarm.core.identity import Identity, peer_id_to_bytes, public_key_to_peer_id, verify

METADATA_KEY = "swarm-ticket-bin"
_TICKET_MAGIC = b"SWT1"
_HANDSHAKE_CONTEXT = b"swarm-handshake-v1"
_TICKET_LIFETIME = 3600.0
_MAX_CLOCK_SKEW = 300.0
_HEADER = struct.Struct("!4s32sdQH")  # magic, caller public key, expiry, nonce, callee id length
_SIGNATURE_BYTES = 64


def make_ticket(identity: Identity, callee_peer_id: str, lifetime: float = _TICKET_LIFETIME) -> bytes:
    callee = peer_id_to_bytes(callee_peer_id)
    body = _HEADER.pack(
        _TICKET_MAGIC, identity.public_key, time.time() + lifetime, int.from_bytes(os.urandom(8), "big"), len(callee)
    ) + callee
    return body + identity.sign(body)


class TicketSigner:
    """Caller side: one ticket per callee, renewed well before it expires."""

    def __init__(self, identity: Identity, extra: tuple[tuple[str, bytes], ...] = ()) -> None:
        self.identity = identity
        self.extra = extra  # sent beside every ticket: a private swarm's membership proof
        self._tickets: dict[str, tuple[float, tuple[tuple[str, bytes], ...]]] = {}

    def metadata_for(self, callee_peer_id: str) -> tuple[tuple[str, bytes], ...]:
        now = time.time()
        cached = self._tickets.get(callee_peer_id)
        if cached is None or cached[0] < now:
            ticket = make_ticket(self.identity, callee_peer_id)
            cached = (now + _TICKET_LIFETIME / 2, ((METADATA_KEY, ticket), *self.extra))
            self._tickets[callee_peer_id] = cached
        return cached[1]


class TicketVerifier:
    """Callee side: verifies tickets addressed to `own_peer_id` and caches the verified ones."""

    def __init__(self, own_peer_id: str, cache_size: int = 16384) -> None:
        self.own_peer_id = own_peer_id
        self._own_bytes = peer_id_to_bytes(own_peer_id)
        self._cache: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._cache_size = cache_size

    def caller_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """PeerID of the caller whose ticket is in `metadata`; raises `Unauthenticated` otherwise."""
        ticket = None
        for key, value in metadata or ():
            if key == METADATA_KEY:
                ticket = value
                break
        if not isinstance(ticket, bytes):
            raise Unauthenticated("call carries no swarm ticket: callers must authenticate with their PeerID")
        now = time.time()
        cached = self._cache.get(ticket)
        if cached is not None and cached[1] > now:
            return cached[0]
        peer_id, expiry = self._verify(ticket, now)
        self._cache[ticket] = (peer_id, expiry)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return peer_id

    def _verify(self, ticket: bytes, now: float) -> tuple[str, float]:
        if len(ticket) < _HEADER.size + _SIGNATURE_BYTES:
            raise Unauthenticated("malformed swarm ticket")
        magic, public_key, expiry, _nonce, callee_len = _HEADER.unpack_from(ticket)
        body_len = _HEADER.size + callee_len
        if magic != _TICKET_MAGIC or len(ticket) != body_len + _SIGNATURE_BYTES:
            raise Unauthenticated("malformed swarm ticket")
        if ticket[_HEADER.size:body_len] != self._own_bytes:
            raise Unauthenticated("ticket is addressed to another peer (replayed or misrouted)")
        if not now - _MAX_CLOCK_SKEW < expiry < now + _TICKET_LIFETIME + _MAX_CLOCK_SKEW:
            raise Unauthenticated("ticket expired or not yet valid (check this machine's clock)")
        peer_id = public_key_to_peer_id(public_key)
        if not verify(peer_id, ticket[:body_len], ticket[body_len:]):
            raise Unauthenticated("ticket signature does not match the caller's key")
        return peer_id, min(expiry, now + _TICKET_LIFETIME)


def handshake_payload(challenge: bytes, caller_peer_id: str, callee_peer_id: str) -> bytes:
    return b"|".join((_HANDSHAKE_CONTEXT, challenge, caller_peer_id.encode(), callee_peer_id.encode()))


def check_handshake(
    expected_peer_id: str, public_key: bytes, signature: bytes, challenge: bytes, caller_peer_id: str
) -> None:
    """Raises `Unauthenticated` unless the callee proved it holds `expected_peer_id`'s key."""
    if len(public_key) != 32 or public_key_to_peer_id(public_key) != expected_peer_id:
        raise Unauthenticated(f"peer at this address is not {expected_peer_id}", peer_id=expected_peer_id)
    if not verify(expected_peer_id, handshake_payload(challenge, caller_peer_id, expected_peer_id), signature):
        raise Unauthenticated(f"peer failed to prove it is {expected_peer_id}", peer_id=expected_peer_id)
