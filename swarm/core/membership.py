"""Private swarms: who is invited, proven without a server (docs/security.md, "Private swarms").

An *authority* is an Ed25519 key that the organizer of a swarm keeps offline. It signs

- **membership certificates**: one PeerID, its roles, an expiry, a serial; and
- **revocation lists**: PeerIDs and certificate serials that are no longer members, numbered so
  that a newer list replaces an older one.

A peer started with the authority's public key and its own certificate presents the certificate
to every peer it talks to and refuses every peer without a valid one (`swarm.net.membership`).
A certificate is bound to one PeerID, and every connection proves its PeerID (TLS and the call
tickets), so a certificate copied by someone else is useless to them.

The simpler mode for small groups is a pre-shared *swarm key* (`SwarmKey`): whoever holds the
key is a member with every role; there are no roles, no expiry and no revocation short of a new
key. Both modes implement `MembershipPolicy`, the seam the network layer checks through.

Everything here is pure: no sockets, no clock but the `now` its callers pass.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.core.errors import ConfigError, IdentityError, PermissionDenied
from swarm.core.identity import peer_id_to_bytes, peer_id_to_public_key, public_key_to_peer_id

ROLES = ("trainer", "server", "relay", "archive", "observer")
"""Roles a certificate may grant: `trainer` averages and trains, `server` declares and serves
experts, `relay` relays for peers behind NAT, `archive` keeps a run's state, `observer` only reads
(the DHT, the dashboard). A certificate naming any other role is refused ("unknown role")."""

CERTIFICATE_VERSION = 1
REVOCATIONS_VERSION = 1
MAX_CLOCK_SKEW = 300.0
"""Seconds a certificate may appear to start in the future (the two machines' clocks differ)."""
MAX_PROOF_BYTES = 1024
"""The longest membership proof accepted; anything longer is malformed before it is parsed."""
MAX_REVOCATION_BYTES = 256 << 10

_CERTIFICATE_CONTEXT = b"swarm-membership-certificate-v1\x00"
_REVOCATIONS_CONTEXT = b"swarm-revocation-list-v1\x00"
_SWARM_KEY_CONTEXT = b"swarm-psk-membership-v1\x00"
_SWARM_KEY_MAGIC = b"PSK1"
_AUTHORITY_PREFIX = "swarm-authority:"
_AUTHORITY_FILE_HEADER = "swarm authority private key v1"
_SWARM_KEY_HEADER = "/key/swarm/psk/1.0.0/"  # libp2p's private-network key file format (pnet spec)


# -- reasons -------------------------------------------------------------------------------------

MISSING = "missing"
MALFORMED = "malformed"
FORGED = "forged"
WRONG_AUTHORITY = "wrong authority"
WRONG_PEER_ID = "wrong PeerID"
EXPIRED = "expired"
NOT_YET_VALID = "not yet valid"
REVOKED = "revoked"
UNKNOWN_ROLE = "unknown role"
WRONG_SWARM_KEY = "wrong swarm key"
REASONS = (MISSING, MALFORMED, FORGED, WRONG_AUTHORITY, WRONG_PEER_ID, EXPIRED, NOT_YET_VALID, REVOKED,
           UNKNOWN_ROLE, WRONG_SWARM_KEY)


class MembershipRefused(PermissionDenied):
    """A peer's membership proof is not valid in this swarm; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, message: str, *, peer_id: str | None = None) -> None:
        super().__init__(f"not a member of this private swarm ({reason}): {message}", peer_id=peer_id)
        self.reason = reason


# -- the authority ---------------------------------------------------------------------------------

def format_authority(public_key: bytes) -> str:
    """The text form of an authority's public key, as `--swarm-authority` takes it."""
    return _AUTHORITY_PREFIX + base64.urlsafe_b64encode(public_key).decode().rstrip("=")


def parse_authority(text: str) -> bytes:
    """The 32-byte public key of `--swarm-authority` text (`swarm-authority:…`, or 64 hex digits).

    Raises `ConfigError` for anything else.
    """
    text = text.strip()
    try:
        if text.startswith(_AUTHORITY_PREFIX):
            body = text[len(_AUTHORITY_PREFIX):]
            key = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        elif re.fullmatch(r"[0-9a-fA-F]{64}", text):
            key = bytes.fromhex(text)
        else:
            raise ValueError
        if len(key) != 32:
            raise ValueError
        Ed25519PublicKey.from_public_bytes(key)
    except ValueError:
        raise ConfigError(f"not a swarm authority public key: {text[:80]!r} (expected {_AUTHORITY_PREFIX}… "
                          "as `swarm-peer authority init` prints it)") from None
    return key


class Authority:
    """The organizer's signing key: it issues certificates and revocation lists.

    Keep its file offline (0600); only its public key (`public_text`) goes to the members.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> Authority:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_text(self) -> str:
        return format_authority(self.public_key)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the key to a new file, mode 0600; an existing file is never overwritten."""
        seed = self._key.private_bytes_raw()
        text = f"{_AUTHORITY_FILE_HEADER}\n{seed.hex()}\n{self.public_text}\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"{path} exists: an authority key is never overwritten") from None
        with os.fdopen(fd, "w") as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Authority:
        """Reads a key written by `save`; refuses a file others may read, as ssh does."""
        try:
            mode = os.stat(path).st_mode
            lines = Path(path).read_text().split()
        except OSError as e:
            raise ConfigError(f"cannot read the authority key {path}: {e.strerror}") from None
        if mode & 0o077:
            raise IdentityError(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
        if len(lines) < 6 or " ".join(lines[:5]) != _AUTHORITY_FILE_HEADER or not re.fullmatch(r"[0-9a-f]{64}", lines[5]):
            raise ConfigError(f"{path} is not a swarm authority key (made by `swarm-peer authority init`)")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(lines[5])))

    def invite(self, peer_id: str, roles: tuple[str, ...] | list[str], expires_in: float, *,
               now: float | None = None) -> MembershipCertificate:
        """A certificate for `peer_id` with `roles`, valid from now for `expires_in` seconds."""
        unknown = [r for r in roles if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(unknown)}: roles are {', '.join(ROLES)}")
        if not roles:
            raise ValueError(f"a certificate needs at least one role ({', '.join(ROLES)})")
        if expires_in <= 0:
            raise ValueError(f"expires_in must be positive, got {expires_in}")
        _check_peer_id(peer_id)  # a malformed PeerID fails here, not in a member's log later
        issued = int(time.time() if now is None else now)
        unsigned = MembershipCertificate(self.public_key, peer_id, tuple(sorted(set(roles))), issued,
                                         issued + int(expires_in), os.urandom(8), b"")
        return unsigned.signed(self._key.sign(unsigned.payload()))

    def revoke(self, peer_ids: tuple[str, ...] | list[str] = (), serials: tuple[bytes, ...] | list[bytes] = (), *,
               previous: RevocationList | None = None, now: float | None = None) -> RevocationList:
        """A revocation list naming `peer_ids` and certificate `serials`, plus those of `previous`,
        numbered one past it (so every peer that sees both keeps this one)."""
        for peer_id in peer_ids:
            _check_peer_id(peer_id)
        if previous is not None and previous.authority != self.public_key:
            raise ValueError("the previous revocation list was signed by another authority")
        old_peers = previous.peer_ids if previous is not None else frozenset()
        old_serials = previous.serials if previous is not None else frozenset()
        number = (previous.number + 1) if previous is not None else 1
        unsigned = RevocationList(self.public_key, number, int(time.time() if now is None else now),
                                  frozenset(peer_ids) | old_peers, frozenset(serials) | old_serials, b"")
        return unsigned.signed(self._key.sign(unsigned.payload()))


def _check_peer_id(peer_id: str) -> None:
    try:
        peer_id_to_public_key(peer_id)
    except (IdentityError, ValueError):
        raise ValueError(f"not an Ed25519 PeerID: {peer_id!r}") from None


def _verify(public_key: bytes, signature: bytes, payload: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, payload)
    except (InvalidSignature, ValueError):
        return False
    return True


# -- certificates ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MembershipCertificate:
    """One PeerID's membership, signed by the authority. `encode` is its compact wire form: a
    msgpack array [version, authority key, PeerID bytes, roles, issued, expires, serial, signature]."""

    authority: bytes
    peer_id: str
    roles: tuple[str, ...]
    issued_at: int
    expires_at: int
    serial: bytes
    signature: bytes

    def _fields(self) -> list[object]:
        return [CERTIFICATE_VERSION, self.authority, peer_id_to_bytes(self.peer_id), list(self.roles),
                self.issued_at, self.expires_at, self.serial]

    def payload(self) -> bytes:
        """The bytes the authority signs."""
        return _CERTIFICATE_CONTEXT + msgpack.packb(self._fields(), use_bin_type=True)

    def signed(self, signature: bytes) -> MembershipCertificate:
        return MembershipCertificate(self.authority, self.peer_id, self.roles, self.issued_at, self.expires_at,
                                     self.serial, signature)

    def encode(self) -> bytes:
        return msgpack.packb([*self._fields(), self.signature], use_bin_type=True)

    def to_text(self) -> str:
        """The form kept in a `--membership` file (one line of URL-safe base64)."""
        return base64.urlsafe_b64encode(self.encode()).decode()

    @classmethod
    def decode(cls, data: bytes) -> MembershipCertificate:
        """Parses the wire form; raises `MembershipRefused(MALFORMED)` for anything else."""
        if len(data) > MAX_PROOF_BYTES:
            raise MembershipRefused(MALFORMED, f"certificate of {len(data)} bytes (the most is {MAX_PROOF_BYTES})")
        try:
            items = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_PROOF_BYTES,
                                    max_str_len=MAX_PROOF_BYTES, max_array_len=64, max_map_len=0)
            version, authority, peer, roles, issued, expires, serial, signature = items
            if version != CERTIFICATE_VERSION:
                raise MembershipRefused(MALFORMED, f"certificate version {version!r} (this peer reads "
                                                   f"{CERTIFICATE_VERSION})")
            if not (isinstance(authority, bytes) and len(authority) == 32 and isinstance(peer, bytes)
                    and isinstance(roles, list) and all(isinstance(r, str) for r in roles)
                    and type(issued) is int and type(expires) is int and isinstance(serial, bytes)
                    and isinstance(signature, bytes) and len(signature) == 64 and len(serial) <= 32):
                raise ValueError("field types")
            peer_id = _peer_id_of(peer)
        except MembershipRefused:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise MembershipRefused(MALFORMED, f"not a membership certificate ({type(e).__name__})") from None
        return cls(authority, peer_id, tuple(roles), issued, expires, serial, signature)

    @classmethod
    def from_text(cls, text: str) -> MembershipCertificate:
        body = text.strip()
        try:
            data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            raise MembershipRefused(MALFORMED, "not base64 (a --membership file holds one line made by "
                                               "`swarm-peer invite`)") from None
        return cls.decode(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MembershipCertificate:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the membership certificate {path}: {e}") from None
        try:
            return cls.from_text(text)
        except MembershipRefused as e:
            raise ConfigError(f"{path}: {e}") from None


def _peer_id_of(raw: bytes) -> str:
    """The PeerID string of `peer_id_to_bytes`'s output (an identity multihash of an Ed25519 key)."""
    import base58

    peer_id = base58.b58encode(raw).decode()
    if peer_id_to_bytes(peer_id) != raw or len(raw) != 38 or public_key_to_peer_id(raw[6:]) != peer_id:
        raise ValueError("not an Ed25519 PeerID")
    return peer_id


@dataclass(frozen=True)
class Member:
    """What a valid proof says: who, with which roles, until when."""

    peer_id: str
    roles: frozenset[str]
    expires_at: float
    serial: bytes = b""

    def has(self, role: str) -> bool:
        return role in self.roles


# -- revocation lists ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RevocationList:
    """PeerIDs and certificate serials the authority revoked; a higher `number` replaces a lower."""

    authority: bytes
    number: int
    issued_at: int
    peer_ids: frozenset[str]
    serials: frozenset[bytes]
    signature: bytes

    def _fields(self) -> list[object]:
        return [REVOCATIONS_VERSION, self.authority, self.number, self.issued_at,
                sorted(peer_id_to_bytes(p) for p in self.peer_ids), sorted(self.serials)]

    def payload(self) -> bytes:
        return _REVOCATIONS_CONTEXT + msgpack.packb(self._fields(), use_bin_type=True)

    def signed(self, signature: bytes) -> RevocationList:
        return RevocationList(self.authority, self.number, self.issued_at, self.peer_ids, self.serials, signature)

    def encode(self) -> bytes:
        return msgpack.packb([*self._fields(), self.signature], use_bin_type=True)

    def revokes(self, member: Member) -> bool:
        return member.peer_id in self.peer_ids or (bool(member.serial) and member.serial in self.serials)

    @classmethod
    def decode(cls, data: bytes, authority: bytes) -> RevocationList:
        """Parses and verifies a list; raises `MembershipRefused` (MALFORMED, WRONG_AUTHORITY, FORGED)."""
        if len(data) > MAX_REVOCATION_BYTES:
            raise MembershipRefused(MALFORMED, f"revocation list of {len(data)} bytes")
        try:
            version, signer, number, issued, peers, serials, signature = msgpack.unpackb(
                data, raw=False, strict_map_key=False, max_map_len=0)
            if version != REVOCATIONS_VERSION:
                raise ValueError(f"version {version!r}")
            if not (isinstance(signer, bytes) and type(number) is int and type(issued) is int
                    and isinstance(peers, list) and isinstance(serials, list) and isinstance(signature, bytes)
                    and all(isinstance(s, bytes) for s in serials)):
                raise ValueError("field types")
            revocations = cls(signer, number, issued, frozenset(_peer_id_of(p) for p in peers),
                              frozenset(serials), signature)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise MembershipRefused(MALFORMED, f"not a revocation list ({e})") from None
        if signer != authority:
            raise MembershipRefused(WRONG_AUTHORITY, "the revocation list is signed by another authority")
        if not _verify(authority, signature, revocations.payload()):
            raise MembershipRefused(FORGED, "the revocation list's signature does not verify")
        return revocations

    @classmethod
    def load(cls, path: str | os.PathLike[str], authority: bytes) -> RevocationList:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read the revocation list {path}: {e.strerror}") from None
        try:
            return cls.decode(data, authority)
        except MembershipRefused as e:
            raise ConfigError(f"{path}: {e}") from None


# -- policies: what a peer presents, and how it judges others -----------------------------------------

class MembershipPolicy(Protocol):
    """How a private swarm proves membership: the proof this peer presents, and the check of a peer's.

    `check` is pure and may be slow (a signature); callers cache its answers (`swarm.net.membership`).
    """

    @property
    def proof(self) -> bytes:
        """What this peer presents to every peer it talks to."""
        ...

    @property
    def own(self) -> Member:
        """This peer's own membership (its roles)."""
        ...

    def check(self, peer_id: str, proof: bytes, now: float) -> Member:
        """The membership `proof` gives `peer_id` at `now`; raises `MembershipRefused` with the reason."""
        ...


@dataclass
class CertificatePolicy:
    """Membership by the authority's certificates, with its revocation lists.

    Args:
        authority: the authority's public key (32 bytes; `parse_authority`).
        certificate: this peer's own certificate, issued by that authority.
        revocations: the newest revocation list known (`apply` replaces it with a newer one).
    """

    authority: bytes
    certificate: MembershipCertificate
    revocations: RevocationList | None = None
    _proof: bytes = field(default=b"", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.certificate.authority != self.authority:
            raise ConfigError("this peer's membership certificate was issued by another authority than "
                              f"--swarm-authority ({format_authority(self.certificate.authority)})")
        if not _verify(self.authority, self.certificate.signature, self.certificate.payload()):
            raise ConfigError("this peer's membership certificate does not verify (altered or forged)")
        self._proof = self.certificate.encode()

    @property
    def proof(self) -> bytes:
        return self._proof

    @property
    def own(self) -> Member:
        c = self.certificate
        return Member(c.peer_id, frozenset(c.roles), float(c.expires_at), c.serial)

    def apply(self, revocations: RevocationList) -> bool:
        """Takes `revocations` if it is newer than the list held (it must be verified: `decode`)."""
        if revocations.authority != self.authority:
            raise MembershipRefused(WRONG_AUTHORITY, "the revocation list is signed by another authority")
        if self.revocations is not None and revocations.number <= self.revocations.number:
            return False
        self.revocations = revocations
        return True

    def check(self, peer_id: str, proof: bytes, now: float) -> Member:
        if not proof:
            raise MembershipRefused(MISSING, "it presented no membership certificate", peer_id=peer_id)
        certificate = MembershipCertificate.decode(proof)
        if certificate.authority != self.authority:
            raise MembershipRefused(WRONG_AUTHORITY, "its certificate was issued by another authority "
                                    f"({format_authority(certificate.authority)})", peer_id=peer_id)
        if not _verify(self.authority, certificate.signature, certificate.payload()):
            raise MembershipRefused(FORGED, "its certificate's signature does not verify", peer_id=peer_id)
        if certificate.peer_id != peer_id:
            raise MembershipRefused(WRONG_PEER_ID, f"its certificate is for {certificate.peer_id}", peer_id=peer_id)
        unknown = [r for r in certificate.roles if r not in ROLES]
        if unknown:
            raise MembershipRefused(UNKNOWN_ROLE, f"its certificate grants {', '.join(unknown)}", peer_id=peer_id)
        if now >= certificate.expires_at:
            raise MembershipRefused(EXPIRED, f"its certificate expired {now - certificate.expires_at:.0f} s ago",
                                    peer_id=peer_id)
        if certificate.issued_at > now + MAX_CLOCK_SKEW:
            raise MembershipRefused(NOT_YET_VALID, "its certificate starts in the future (check the clocks)",
                                    peer_id=peer_id)
        member = Member(peer_id, frozenset(certificate.roles), float(certificate.expires_at), certificate.serial)
        if self.revocations is not None and self.revocations.revokes(member):
            raise MembershipRefused(REVOKED, f"the authority revoked it (revocation list {self.revocations.number})",
                                    peer_id=peer_id)
        return member


class SwarmKey:
    """A pre-shared key: every holder is a member with every role (the small-group mode).

    The file is libp2p's private-network key format (`/key/swarm/psk/1.0.0/`, `/base16/`, 64 hex
    digits). A proof is HMAC-SHA256(key, PeerID): it shows the key's holder vouched for that
    PeerID, and like a certificate it is worth nothing to another PeerID.
    """

    def __init__(self, key: bytes, peer_id: str) -> None:
        if len(key) != 32:
            raise ConfigError(f"a swarm key is 32 bytes, got {len(key)}")
        self._key = key
        self.peer_id = peer_id
        self._proof = self._mac(peer_id)

    @staticmethod
    def generate_text() -> str:
        """A new key file's contents."""
        return f"{_SWARM_KEY_HEADER}\n/base16/\n{os.urandom(32).hex()}\n"

    @staticmethod
    def read(path: str | os.PathLike[str]) -> bytes:
        """The 32 key bytes of a key file; refuses a file others may read."""
        try:
            mode = os.stat(path).st_mode
            lines = Path(path).read_text().split()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the swarm key {path}: {e}") from None
        if mode & 0o077:
            raise IdentityError(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
        if len(lines) != 3 or lines[0] != _SWARM_KEY_HEADER or lines[1] != "/base16/" or not re.fullmatch(
                r"[0-9a-fA-F]{64}", lines[2]):
            raise ConfigError(f"{path} is not a swarm key file ({_SWARM_KEY_HEADER}, /base16/, 64 hex digits)")
        return bytes.fromhex(lines[2])

    def _mac(self, peer_id: str) -> bytes:
        return _SWARM_KEY_MAGIC + hmac.new(self._key, _SWARM_KEY_CONTEXT + peer_id_to_bytes(peer_id),
                                           hashlib.sha256).digest()

    @property
    def proof(self) -> bytes:
        return self._proof

    @property
    def own(self) -> Member:
        return Member(self.peer_id, frozenset(ROLES), float("inf"))

    def check(self, peer_id: str, proof: bytes, now: float) -> Member:
        if not proof:
            raise MembershipRefused(MISSING, "it presented no swarm-key proof", peer_id=peer_id)
        if len(proof) != len(self._proof) or not proof.startswith(_SWARM_KEY_MAGIC):
            raise MembershipRefused(MALFORMED, "its proof is not a swarm-key proof (a certificate? this swarm "
                                               "uses a pre-shared key)", peer_id=peer_id)
        if not hmac.compare_digest(proof, self._mac(peer_id)):
            raise MembershipRefused(WRONG_SWARM_KEY, "its proof was made with another swarm key, or for "
                                                     "another PeerID", peer_id=peer_id)
        return Member(peer_id, frozenset(ROLES), float("inf"))


def parse_duration(text: str) -> float:
    """Seconds in `30d`, `12h`, `45m`, `90s` or a bare number of seconds (`--expires`)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (e.g. 30d, 12h, 45m, 90s)")
    scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[match.group(2)]
    return float(match.group(1)) * scale
