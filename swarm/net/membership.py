"""The gate of a private swarm: every call's caller, and every callee, must prove membership
(docs/security.md, "Private swarms").

The proof (a membership certificate or a swarm-key proof, `swarm.core.membership`) is bound to a
PeerID, and the transport already proves PeerIDs: the callee's by TLS, the caller's by its ticket
(`swarm.net.auth`). So:

- **the caller's side**: every call carries the caller's proof in its metadata next to its
  ticket (HTTP/2 header compression sends it in full once per connection). The server checks it
  with the ticket, before admission and before any handler runs (`RPCServer`), on every path:
  unary calls, streams, each call multiplexed on a Calls stream, and bulk streams (whose one-time
  tokens come from a checked `OpenBulk` call). A refusal is PERMISSION_DENIED with the reason.
- **the callee's side**: the first use of a channel, once TLS proved the callee's PeerID, asks
  the callee for its proof (`Membership`, one round trip per channel: that call's metadata also
  carries the caller's proof, so a non-member callee learns nothing but a refusal) and refuses a
  callee without a valid one before sending any request.

A verified proof is cached (later calls cost a dict lookup); a refused proof is remembered too,
so a stranger repeating an attempt costs no second signature check. An address whose attempts
were refused `max_refusals` times within `refusal_window` seconds is throttled: its next
refusals cache nothing and log nothing but one line per window, and answer "too many refused
attempts". A valid proof still passes from a throttled address (at the cost of one signature
check), so an intruder behind a member's NAT cannot lock the member out. Refusals are logged with
their reason, at most one line per address and reason per window.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from swarm.core.errors import ConfigError, PermissionDenied
from swarm.core.membership import (
    MAX_PROOF_BYTES,
    CertificatePolicy,
    Member,
    MembershipCertificate,
    MembershipPolicy,
    MembershipRefused,
    RevocationList,
    SwarmKey,
    parse_authority,
)

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

METADATA_KEY = "swarm-membership-bin"
MEMBERSHIP = "/swarm.Peer/Membership"
THROTTLED = "too many refused attempts"


@dataclass(frozen=True)
class GateConfig:
    """Limits of the gate.

    Attributes:
        max_refusals: refused attempts from one address within `refusal_window` after which its
            further attempts are refused without being read.
        refusal_window: seconds over which `max_refusals` counts, and between two log lines about
            one address and reason.
        cache_size: verified and refused proofs remembered (least recently used go first).
    """

    max_refusals: int = 16
    refusal_window: float = 60.0
    cache_size: int = 4096

    def __post_init__(self) -> None:
        if self.max_refusals < 1 or self.refusal_window <= 0 or self.cache_size < 1:
            raise ConfigError("max_refusals, refusal_window and cache_size must be positive")


class MembershipGate:
    """Admits members and refuses everyone else, for both sides of every connection.

    Roles are checked where a method needs one: `caller_roles` maps a method path prefix to the
    roles of which a caller must hold one (e.g. the averaging service: trainers), `callee_roles`
    the roles a callee must hold for this peer to call it (e.g. experts: servers).

    Args:
        policy: how proofs are made and checked (certificates, or a swarm key).
        config: the gate's limits.
        clock: seconds since the epoch (certificates expire in wall-clock time).
        caller_roles: method path prefix -> roles, one of which a caller needs.
        callee_roles: method path prefix -> roles, one of which a callee needs.
    """

    def __init__(self, policy: MembershipPolicy, config: GateConfig | None = None,
                 clock: Callable[[], float] = time.time, *,
                 caller_roles: Mapping[str, frozenset[str]] | None = None,
                 callee_roles: Mapping[str, frozenset[str]] | None = None) -> None:
        self.policy = policy
        self.config = config or GateConfig()
        self.clock = clock
        self.caller_roles = tuple((caller_roles or {}).items())
        self.callee_roles = tuple((callee_roles or {}).items())
        self.metadata: tuple[tuple[str, bytes], ...] = ((METADATA_KEY, policy.proof),)
        """What this peer adds to every call's metadata: its own proof."""
        self.refused: Counter[str] = Counter()
        """Refusals by reason (both sides), for status pages and tests."""
        self.on_revoked: list[Callable[[set[str]], None]] = []
        """Called with the PeerIDs a `revalidate` cut off (the channel pool closes their channels)."""
        self._verified: OrderedDict[bytes, Member] = OrderedDict()
        self._rejected: OrderedDict[tuple[str, bytes], MembershipRefused] = OrderedDict()
        self._members: dict[str, Member] = {}
        self._attempts: dict[str, deque[float]] = {}
        self._logged: dict[tuple[str, str], float] = {}

    @property
    def own(self) -> Member:
        return self.policy.own

    def member(self, peer_id: str) -> Member | None:
        """The membership `peer_id` last proved to this peer, if still valid now."""
        member = self._members.get(peer_id)
        if member is None or member.expires_at <= self.clock():
            return None
        return member

    def admit(self, peer_id: str, metadata: Sequence[tuple[str, str | bytes]] | None, address: str,
              method: str = "") -> Member:
        """The caller's membership from its call's metadata; raises `PermissionDenied` otherwise
        (also when `method` needs a role the caller lacks)."""
        proof: str | bytes = b""
        for key, value in metadata or ():
            if key == METADATA_KEY:
                proof = value
                break
        if not isinstance(proof, bytes):
            proof = b""
        member = self._verified.get(proof) if proof else None
        if member is None or member.peer_id != peer_id or self.clock() >= member.expires_at:
            member = self._check(peer_id, proof, address, "caller")
        if self.caller_roles and method:
            self._require(member, method, self.caller_roles, "caller")
        return member

    def require_callee(self, member: Member, method: str) -> None:
        """Raises `PermissionDenied` if the callee `member`'s membership expired since its channel
        checked it, or if calling `method` needs a role it lacks."""
        if self.clock() >= member.expires_at:
            self.refused["expired"] += 1
            raise MembershipRefused("expired", "its certificate expired while connected", peer_id=member.peer_id)
        if self.callee_roles:
            self._require(member, method, self.callee_roles, "callee")

    def _require(self, member: Member, method: str, rules: tuple[tuple[str, frozenset[str]], ...], side: str) -> None:
        for prefix, roles in rules:
            if method.startswith(prefix) and not roles & member.roles:
                self.refused["missing role"] += 1
                self._log(member.peer_id, "missing role", f"refused {side} {member.peer_id} for {method}: "
                                                          f"it lacks the role {' or '.join(sorted(roles))}")
                raise PermissionDenied(f"{member.peer_id} lacks the role {' or '.join(sorted(roles))} that "
                                       f"{method} needs in this private swarm (its roles: "
                                       f"{', '.join(sorted(member.roles))})", peer_id=member.peer_id)

    def still_member(self, peer_id: str, method: str = "") -> Member:
        """For calls on a connection whose caller proved membership before (a bulk stream): raises
        `PermissionDenied` if it no longer holds (expired, or revoked since), or if `method` needs a
        role it lacks."""
        member = self.member(peer_id)
        if member is None:
            self.refused["no longer a member"] += 1
            raise PermissionDenied(f"{peer_id} is no longer a member of this private swarm (its certificate "
                                   "expired or was revoked)", peer_id=peer_id)
        if self.caller_roles and method:
            self._require(member, method, self.caller_roles, "caller")
        return member

    def check_callee(self, peer_id: str, proof: bytes, address: str) -> Member:
        """The callee's membership from its `Membership` answer; raises `PermissionDenied` otherwise."""
        return self.check_proof(peer_id, proof, address, "callee")

    def check_proof(self, peer_id: str, proof: bytes, address: str, side: str) -> Member:
        """The membership `proof` gives `peer_id` (whose PeerID the caller of this proved already);
        raises `PermissionDenied` otherwise. `side` names the peer in the log ("callee", "relay client")."""
        member = self._verified.get(proof) if proof else None
        if member is not None and member.peer_id == peer_id and self.clock() < member.expires_at:
            return member
        return self._check(peer_id, proof, address, side)

    def roles_of(self, peer_id: str) -> frozenset[str] | None:
        """The roles `peer_id` holds as far as this peer knows (its own, or those a member proved
        to it and still holds); None for a peer not known here."""
        if peer_id == self.policy.own.peer_id:
            return self.policy.own.roles
        member = self.member(peer_id)
        return None if member is None else member.roles

    def refuse(self, peer_id: str, address: str, side: str, reason: str, message: str) -> PermissionDenied:
        """Records a refusal decided before any proof could be checked (a relay's caller that did
        not prove its PeerID): counted, logged and throttled per address like the others. Returns
        the error to raise."""
        error = MembershipRefused(reason, message, peer_id=peer_id or None)
        now = self.clock()
        return self._refused(error, peer_id, address, side, now, None, self._throttled(address, now))

    def _refused(self, error: MembershipRefused, peer_id: str, address: str, side: str, now: float,
                 key: tuple[str, bytes] | None, throttled: bool) -> PermissionDenied:
        self._attempt(address, now)
        if throttled:  # no log line, nothing cached: the address keeps failing
            self.refused[THROTTLED] += 1
            self._log(address, THROTTLED, f"refusing {side}s at {address} quietly: {THROTTLED} "
                                          f"within {self.config.refusal_window:g} s (last: {peer_id}, {error.reason})")
            return PermissionDenied(f"{THROTTLED} from your address ({error.reason})", peer_id=peer_id or None)
        self.refused[error.reason] += 1
        if key is not None:
            self._remember(self._rejected, key, error)
        self._log(address, error.reason, f"refused {side} {peer_id or '(unknown)'} at {address}: {error}")
        return error

    def _check(self, peer_id: str, proof: bytes, address: str, side: str) -> Member:
        now = self.clock()
        key = (peer_id, proof)
        known = self._rejected.get(key)
        throttled = known is None and self._throttled(address, now)  # a known refusal costs nothing to repeat
        try:
            if known is not None:
                raise known.with_traceback(None)
            if len(proof) > MAX_PROOF_BYTES:
                raise MembershipRefused("malformed", f"a proof of {len(proof)} bytes", peer_id=peer_id)
            member = self.policy.check(peer_id, proof, now)
        except MembershipRefused as e:
            error = self._refused(e, peer_id, address, side, now, key, throttled)
            if error is e:
                raise
            raise error from None
        self._remember(self._verified, proof, member)
        self._members[peer_id] = member
        return member

    def revalidate(self) -> set[str]:
        """Checks every cached membership again (after the policy changed: a new revocation list);
        drops those no longer valid, tells `on_revoked`, and returns their PeerIDs."""
        now = self.clock()
        dropped: set[str] = set()
        for proof, member in list(self._verified.items()):
            try:
                self.policy.check(member.peer_id, proof, now)
            except MembershipRefused as e:
                del self._verified[proof]
                self._members.pop(member.peer_id, None)
                dropped.add(member.peer_id)
                logger.warning("private swarm: %s is cut off: %s", member.peer_id, e)
        self._rejected.clear()
        if dropped:
            for callback in self.on_revoked:
                callback(dropped)
        return dropped

    def _remember(self, cache: OrderedDict[K, V], key: K, value: V) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.config.cache_size:
            cache.popitem(last=False)

    def _attempt(self, address: str, now: float) -> None:
        if not address:
            return
        times = self._attempts.get(address)
        if times is None:
            if len(self._attempts) >= self.config.cache_size:
                self._attempts.pop(next(iter(self._attempts)))
            times = self._attempts[address] = deque(maxlen=self.config.max_refusals)
        times.append(now)

    def _throttled(self, address: str, now: float) -> bool:
        times = self._attempts.get(address)
        return (times is not None and len(times) >= self.config.max_refusals
                and now - times[0] < self.config.refusal_window)

    def _log(self, address: str, reason: str, line: str) -> None:
        now = time.monotonic()
        key = (address, reason)
        if now - self._logged.get(key, -1e18) < self.config.refusal_window:
            return
        if len(self._logged) >= self.config.cache_size:
            self._logged.clear()
        self._logged[key] = now
        logger.warning("private swarm: %s", line)


def address_of(peer: str) -> str:
    """The IP address in grpc's `context.peer()` ("ipv4:10.1.2.3:5000" -> "10.1.2.3")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return rest


def certificate_policy(peer_id: str, authority: str | None,
                       membership: str | os.PathLike[str] | MembershipCertificate | None,
                       revocations: str | os.PathLike[str] | RevocationList | None = None) -> CertificatePolicy | None:
    """The certificate policy of a peer started with `--swarm-authority` and `--membership`; None
    without them. Raises `ConfigError` for one without the other, a certificate for another
    PeerID or authority, or an expired one (the peer would be refused everywhere)."""
    if authority is None and membership is None:
        if revocations is not None:
            raise ConfigError("a revocation list needs --swarm-authority and --membership")
        return None
    if authority is None or membership is None:
        raise ConfigError("a private swarm needs both --swarm-authority (the authority's public key) and "
                          "--membership (this peer's certificate, from `swarm-peer invite`)")
    key = parse_authority(authority)
    certificate = membership if isinstance(membership, MembershipCertificate) else MembershipCertificate.load(membership)
    if certificate.peer_id != peer_id:
        raise ConfigError(f"the membership certificate is for {certificate.peer_id}, but this peer is {peer_id}: "
                          "start it with that peer's --identity, or ask the authority to invite this PeerID")
    if certificate.expires_at <= time.time():
        raise ConfigError("this peer's membership certificate has expired: ask the authority for a new one")
    policy = CertificatePolicy(key, certificate)
    if revocations is not None:
        policy.apply(revocations if isinstance(revocations, RevocationList) else RevocationList.load(revocations, key))
    return policy


def swarm_key_policy(peer_id: str, path: str | os.PathLike[str] | None) -> SwarmKey | None:
    """The swarm-key policy of a peer started with `--swarm-key FILE`; None without it."""
    return None if path is None else SwarmKey(SwarmKey.read(path), peer_id)
