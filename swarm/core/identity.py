"""libp2p identities: Ed25519 key pairs, PeerIDs and identity files.

A swarm PeerID is the string go-libp2p prints for the same key: the libp2p `PublicKey`
protobuf (KeyType=Ed25519, Data=32 raw bytes) wrapped in an identity multihash and encoded
in base58btc (libp2p peer-ids spec). It is built from `cryptography` and `base58` directly:
importing py-libp2p is slow and large (BENCHMARKS.md, "Transport facts"); tests hold the
result against py-libp2p's and against fixed vectors.

Identity files hold the libp2p `PrivateKey` protobuf (Data = 32-byte seed + 32-byte public
key, as go-libp2p writes it), are created with mode 0600, and are locked while a peer runs: the
file itself (its inode), so that a symlink or a hard link to a key in use cannot start a second
peer with the same PeerID. A key file that others may read or write is refused, as ssh does.
"""

from __future__ import annotations

import fcntl
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.core.errors import IdentityError

_KEY_TYPE_ED25519 = 1
_PUBKEY_PREFIX = bytes([0x08, _KEY_TYPE_ED25519, 0x12, 0x20])  # field 1 varint, field 2 len 32
_IDENTITY_MULTIHASH = 0x00


def _encode_private_key(seed: bytes, public: bytes) -> bytes:
    return bytes([0x08, _KEY_TYPE_ED25519, 0x12, 0x40]) + seed + public


def _decode_private_key(data: bytes) -> bytes:
    """Returns the 32-byte Ed25519 seed of a libp2p `PrivateKey` protobuf (go or py-libp2p form)."""
    if len(data) < 4 or data[0] != 0x08 or data[2] != 0x12:
        raise IdentityError("not a libp2p private key (expected a PrivateKey protobuf)")
    if data[1] != _KEY_TYPE_ED25519:
        raise IdentityError(f"unsupported libp2p key type {data[1]}: swarm uses Ed25519 keys")
    length = data[3]
    body = data[4:]
    if length != len(body) or length not in (32, 64):
        raise IdentityError(f"corrupt Ed25519 private key: {len(body)} key bytes, header says {length}")
    seed = body[:32]
    if length == 64:
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
        if public != body[32:]:
            raise IdentityError("corrupt Ed25519 private key: public half does not match the seed")
    return seed


def public_key_to_peer_id(public: bytes) -> str:
    """PeerID (base58btc identity multihash) of a raw 32-byte Ed25519 public key."""
    encoded = _PUBKEY_PREFIX + public
    return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded).decode()


def peer_id_to_public_key(peer_id: str) -> bytes:
    """Raw Ed25519 public key inside a PeerID; raises `IdentityError` for other kinds of PeerID."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"not a base58 PeerID: {peer_id!r}") from e
    if len(raw) != 2 + 36 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != 36 or raw[2:6] != _PUBKEY_PREFIX:
        raise IdentityError(f"not an Ed25519 PeerID: {peer_id!r}")
    return raw[6:]


def peer_id_to_bytes(peer_id: str) -> bytes:
    """Binary form of a PeerID (the multihash), as used in multiaddrs and DHT node IDs."""
    try:
        return base58.b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"not a base58 PeerID: {peer_id!r}") from e


@functools.lru_cache(maxsize=4096)
def _verifying_key(peer_id: str) -> Ed25519PublicKey:
    """The key behind a PeerID, kept for the PeerIDs seen last: a peer's DHT records are checked
    against the same few PeerIDs over and over, and decoding one (base58) cost more than checking
    the signature (a trainer's profile, benchmarks/history/BENCHMARKS-2026-12-05.md, "Communication overlapped with compute").
    Invalid PeerIDs raise and are not kept."""
    return Ed25519PublicKey.from_public_bytes(peer_id_to_public_key(peer_id))


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True when `signature` over `data` was made by the key behind `peer_id`."""
    try:
        _verifying_key(peer_id).verify(signature, data)
        return True
    except (InvalidSignature, IdentityError, ValueError):
        return False


@dataclass(frozen=True, eq=False)
class Identity:
    """An Ed25519 key pair and the PeerID derived from it."""

    private_key: Ed25519PrivateKey
    public_key: bytes
    peer_id: str

    @classmethod
    def generate(cls) -> Identity:
        return cls.from_seed(os.urandom(32))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        if len(seed) != 32:
            raise IdentityError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        key = Ed25519PrivateKey.from_private_bytes(seed)
        public = key.public_key().public_bytes_raw()
        return cls(key, public, public_key_to_peer_id(public))

    @classmethod
    def from_private_bytes(cls, data: bytes) -> Identity:
        """Loads a libp2p `PrivateKey` protobuf (the content of an identity file)."""
        return cls.from_seed(_decode_private_key(data))

    def private_bytes(self) -> bytes:
        """The libp2p `PrivateKey` protobuf, as go-libp2p serializes it."""
        seed = self.private_key.private_bytes_raw()
        return _encode_private_key(seed, self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


class IdentityFile:
    """An identity kept on disk, locked for as long as one peer process uses it.

    Two `flock`s, released by the kernel when the holder dies, even by SIGKILL: one on
    `<real path>.lock` (symlinks resolved), which serializes creating the file and records the
    holder's pid, and one on the key file itself, which holds for every path that names the same
    inode (hard links too). A second peer that tries to use the same file gets `IdentityError`,
    as does every other problem with the file (unreadable, not a key, readable by others, a path
    that cannot be created), with a message that says what to do.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None
        self._key_fd: int | None = None

    def load_or_create(self) -> Identity:
        """Locks the file, then loads it, or creates it (mode 0600) if it does not exist.

        Raises:
            IdentityError: The file is in use, unusable or not a key; the message says why.
        """
        try:
            return self._open()
        except OSError as e:
            self.release()
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(self.path) else ""
            raise IdentityError(f"cannot use identity file {self.path}{where}: {e.strerror or e}") from None
        except BaseException:
            self.release()
            raise

    def _open(self) -> Identity:
        real = Path(os.path.realpath(self.path))
        real.parent.mkdir(parents=True, exist_ok=True)
        self._lock(real.with_name(real.name + ".lock"))
        try:
            fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(real, os.O_RDONLY)
            created = False
        self._key_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IdentityError(
                f"identity file {self.path} is in use by another running peer (through another path to "
                "the same file, such as a hard link); give each peer its own --identity"
            ) from None
        if created:
            identity = Identity.generate()
            os.write(fd, identity.private_bytes())
            os.fsync(fd)
            return identity
        identity = self._load(fd)
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise IdentityError(
                f"identity file {self.path} is accessible by other users (mode {mode & 0o777:04o}); "
                f"its private key must be private: chmod 600 {self.path}"
            )
        return identity

    def _load(self, fd: int) -> Identity:
        chunks = []
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 4096:
                raise IdentityError(f"identity file {self.path} is too large to be a swarm/libp2p Ed25519 key")
        try:
            return Identity.from_private_bytes(b"".join(chunks))
        except IdentityError as e:
            raise IdentityError(f"identity file {self.path} is not a swarm/libp2p Ed25519 key: {e}") from e

    def _lock(self, lock_path: Path) -> None:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise IdentityError(
                f"identity file {self.path} is in use by another running peer (pid {holder}); "
                "give each peer its own --identity"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def release(self) -> None:
        for fd in (self._key_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._key_fd = self._lock_fd = None
