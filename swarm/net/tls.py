"""TLS 1.3 bound to libp2p PeerIDs, in a form grpcio's Python API can verify (docs/security.md).

The libp2p TLS spec binds a connection to a PeerID with a self-signed certificate carrying an
extension (OID 1.3.6.1.4.1.53594.1.1) that holds the host's public key and its signature over the
certificate's key; the verifier checks that extension in a custom callback. grpcio's Python API
has no such callback: a channel only accepts root certificates. So a peer's certificate here is
*issued by its libp2p key* instead of self-signed:

- the peer generates a fresh P-256 key at start-up and a certificate for it whose issuer is the
  name `anchor_name(public key)` and whose X.509 signature is made with the peer's Ed25519 key; it
  also carries the libp2p extension (`SignedKey`), so the binding is the spec's as well;
- a caller that dials `/p2p/<PeerID>` builds, from the PeerID alone, a trust anchor with that
  name and the PeerID's Ed25519 public key (`trust_anchor`), and gives it to gRPC as the channel's
  only root. TLS then succeeds only if the callee holds a certificate signed by that very key and
  proves, in the handshake, that it holds the certificate's private key. There is no extra round
  trip and nothing to fetch first. The anchor's own signature is never checked by a verifier (it
  is the trust anchor), so the caller signs it with a throwaway key.

The bulk side channel uses the same certificate with Python's `ssl` and the same anchor.
`read_peer_certificate` reads the PeerID out of a certificate received without verification
(dialing a bare address), checking both the X.509 signature and the libp2p extension.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from swarm.core.errors import Unauthenticated
from swarm.core.identity import Identity, peer_id_to_public_key, public_key_to_peer_id
from swarm.net import der
from swarm.net.sockets import connected_socket

if TYPE_CHECKING:
    from cryptography import x509

# `cryptography.x509` (~3 MB of modules) is imported only to read a certificate received unverified
# (`read_peer_certificate`); the certificates a peer makes are written by `swarm.net.der`.
_LIBP2P_EXTENSION = "1.3.6.1.4.1.53594.1.1"
SERVER_NAME = "swarm-peer"  # the DNS name in every certificate; the PeerID is what is checked
# `ssl` encodes a str server_hostname with the `idna` codec (importing `stringprep` and
# `unicodedata`, ~0.4 MB, for one ASCII name); bytes it takes as they are
SERVER_NAME_BYTES = SERVER_NAME.encode("ascii")
_SIGNED_KEY_PREFIX = b"libp2p-tls-handshake:"
_PUBKEY_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])  # libp2p PublicKey protobuf, Ed25519, 32 bytes
_LEAF_LIFETIME = datetime.timedelta(days=30)
_CLOCK_SKEW = datetime.timedelta(days=1)
ALPN = "h2"


def __getattr__(name: str) -> Any:
    if name == "LIBP2P_EXTENSION_OID":
        from cryptography import x509

        return x509.ObjectIdentifier(_LIBP2P_EXTENSION)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ANCHOR_ORGANIZATION = "swarm libp2p identity"


def anchor_name(public_key: bytes) -> x509.Name:
    """The issuer name of every certificate the key behind `public_key` signs (64 hex digits)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ANCHOR_ORGANIZATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, public_key.hex())])


def _anchor_name_der(public_key: bytes) -> bytes:
    """`anchor_name` in DER, without importing `cryptography.x509`."""
    return der.name([(der.ORGANIZATION_NAME, _ANCHOR_ORGANIZATION), (der.COMMON_NAME, public_key.hex())])


# -- the libp2p SignedKey extension (DER by hand: SEQUENCE { OCTET STRING, OCTET STRING }) --------

def signed_key(identity: Identity, certificate_key_spki: bytes) -> bytes:
    """The libp2p extension's value: the host's PublicKey protobuf and its signature over the
    certificate's SubjectPublicKeyInfo (libp2p TLS spec, "libp2p Public Key Extension")."""
    signature = identity.sign(_SIGNED_KEY_PREFIX + certificate_key_spki)
    return der.tlv(der.SEQUENCE, der.tlv(der.OCTET_STRING, _PUBKEY_PREFIX + identity.public_key)
                   + der.tlv(der.OCTET_STRING, signature))


def _parse_signed_key(value: bytes) -> tuple[bytes, bytes]:
    body, end = der.read(value, 0, der.SEQUENCE)
    if end != len(value):
        raise ValueError("trailing bytes")
    key, offset = der.read(body, 0, der.OCTET_STRING)
    signature, offset = der.read(body, offset, der.OCTET_STRING)
    if offset != len(body) or len(key) != 36 or key[:4] != _PUBKEY_PREFIX:
        raise ValueError("not an Ed25519 libp2p PublicKey")
    return key[4:], signature


# -- certificates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerCertificate:
    """A peer's TLS key and certificate (PEM), issued by its libp2p key; made once per process."""

    key_pem: bytes
    certificate_pem: bytes

    @classmethod
    def issue(cls, identity: Identity) -> PeerCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        point = key.public_key().public_numbers()
        spki = der.p256_spki(point.x, point.y)
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        certificate = der.certificate(
            serial=int.from_bytes(os.urandom(20), "big") >> 1,  # positive, at most 20 octets (RFC 5280)
            issuer=_anchor_name_der(identity.public_key),
            subject=der.name([(der.COMMON_NAME, identity.peer_id)]),
            not_before=now - _CLOCK_SKEW, not_after=now + _LEAF_LIFETIME, spki=spki,
            extensions=[der.extension(der.SUBJECT_ALT_NAME, der.dns_names(SERVER_NAME), critical=False),
                        der.extension(der.BASIC_CONSTRAINTS, der.basic_constraints(ca=False), critical=True),
                        der.extension(_LIBP2P_EXTENSION, signed_key(identity, spki), critical=False)],
            sign=identity.sign)
        return cls(
            der.pem("PRIVATE KEY", der.p256_pkcs8(key.private_numbers().private_value, point.x, point.y)),
            ssl.DER_cert_to_PEM_cert(certificate).encode(),
        )


@functools.lru_cache(maxsize=1)
def _anchor_signer() -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.generate()


@functools.lru_cache(maxsize=4096)
def trust_anchor(peer_id: str) -> bytes:
    """PEM of the root that makes TLS accept exactly the certificates signed by `peer_id`'s key.

    Raises `Unauthenticated` for a PeerID that holds no Ed25519 key (nothing could prove it).
    """
    try:
        public_key = peer_id_to_public_key(peer_id)
    except Exception:  # noqa: BLE001 - IdentityError, or garbage from a record
        raise Unauthenticated(f"{peer_id!r} is not an Ed25519 PeerID: no TLS certificate can prove it",
                              peer_id=peer_id) from None
    name = _anchor_name_der(public_key)
    anchor = der.certificate(
        serial=1, issuer=name, subject=name,
        not_before=datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC),
        not_after=datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC),
        spki=der.ed25519_spki(public_key),
        extensions=[der.extension(der.BASIC_CONSTRAINTS, der.basic_constraints(ca=True, path_length=0), critical=True),
                    der.extension(der.KEY_USAGE, der.KEY_CERT_SIGN_ONLY, critical=True)],
        sign=_anchor_signer().sign)  # a trust anchor's own signature is not verified
    return ssl.DER_cert_to_PEM_cert(anchor).encode()


def read_peer_certificate(der: bytes) -> str:
    """The PeerID a certificate proves (its X.509 signature and its libp2p extension both made by
    that key); raises `Unauthenticated` otherwise. Used on certificates received unverified."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        certificate = x509.load_der_x509_certificate(der)
        value = certificate.extensions.get_extension_for_oid(x509.ObjectIdentifier(_LIBP2P_EXTENSION)).value
        public_key, signature = _parse_signed_key(value.value)  # type: ignore[attr-defined]
        host_key = ed25519.Ed25519PublicKey.from_public_bytes(public_key)
        spki = certificate.public_key().public_bytes(serialization.Encoding.DER,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo)
        host_key.verify(signature, _SIGNED_KEY_PREFIX + spki)
        host_key.verify(certificate.signature, certificate.tbs_certificate_bytes)
        if certificate.issuer != anchor_name(public_key):
            raise ValueError("issuer is not the host key")
    except (ValueError, InvalidSignature, x509.ExtensionNotFound, TypeError) as e:
        raise Unauthenticated(f"the peer's TLS certificate does not prove a libp2p identity ({e or type(e).__name__})"
                              ) from None
    return public_key_to_peer_id(public_key)


# -- Python ssl contexts (the bulk side channel, probes) ------------------------------------------

class ServerContext(ssl.SSLContext):
    """An `ssl.SSLContext` that also knows the DER of the certificate it presents (the bulk
    channel binds its record keys to it, `swarm.net.sealed`)."""

    certificate_der: bytes = b""


def server_context(certificate: PeerCertificate) -> ServerContext:
    """TLS 1.3 server context presenting `certificate` (the bulk listener)."""
    context = ServerContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # no session resumption: each bulk connection is a full handshake
    context.certificate_der = ssl.PEM_cert_to_DER_cert(certificate.certificate_pem.decode())
    _load_chain(context, certificate.key_pem + certificate.certificate_pem)
    return context


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    """`load_cert_chain` reads files only: an anonymous in-memory file where Linux has one (the key
    never reaches a disk, and no `tempfile`, with the `shutil` it imports), else a private
    temporary directory, removed at once."""
    fd = _memory_file()
    if fd is not None:
        try:
            view = memoryview(pem)
            while view:
                view = view[os.write(fd, view):]
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="swarm-tls-") as tmp:
        path = os.path.join(tmp, "peer.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        context.load_cert_chain(path)


def _memory_file() -> int | None:
    """A memfd readable by path (/proc/self/fd/N); None where there is none (not Linux, no /proc,
    or a sandbox that refuses the call)."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.memfd_create("swarm-tls", os.MFD_CLOEXEC)
    except OSError:
        return None


@functools.lru_cache(maxsize=1024)
def client_context(peer_id: str) -> ssl.SSLContext:
    """TLS 1.3 client context that accepts only certificates signed by `peer_id`'s key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=trust_anchor(peer_id).decode())
    return context


@functools.lru_cache(maxsize=1)
def _unverified_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the certificate is checked by read_peer_certificate
    context.set_alpn_protocols([ALPN])
    return context


@dataclass(frozen=True)
class Probe:
    """What a TLS handshake with an address showed (`probe`)."""

    reachable: bool       # a TCP connection was accepted
    speaks_tls: bool      # the TLS 1.3 handshake completed
    peer_id: str | None   # the PeerID its certificate proves (None: it proves none)
    error: str = ""


async def probe(host: str, port: int, timeout: float) -> Probe:
    """Runs one TLS handshake with `host:port`, verifying nothing, and reads the PeerID that the
    certificate proves. Used to learn a bare address's PeerID and to explain a failed dial."""
    tls = await _connect(host, port, _unverified_context(), timeout)
    if isinstance(tls, Probe):
        return tls
    with tls:  # a probe: closed without a close_notify exchange (a gRPC server may never answer it)
        der = tls.getpeercert(binary_form=True)
    try:
        peer_id = read_peer_certificate(der) if der else None
        error = ""
    except Unauthenticated as e:
        peer_id, error = None, str(e)
    return Probe(True, True, peer_id, error)


async def prove(host: str, port: int, peer_id: str, timeout: float) -> Probe:
    """Runs one TLS handshake with `host:port` that completes only if the certificate there is
    issued by `peer_id`'s key, checked by OpenSSL against `peer_id`'s trust anchor as a bulk
    connection's is (a dial-back knows whom it expects). No certificate is parsed here, so a peer
    answering dial-backs never loads `cryptography.x509` (~3.6 MB, BENCHMARKS.md) for them.
    `Probe.peer_id` is `peer_id` when proved, else None with the reason."""
    try:
        anchor = trust_anchor(peer_id)
    except Unauthenticated as e:  # no Ed25519 key in it: nothing there can prove it
        return Probe(False, False, None, str(e))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # not cached: one per dial-back, rare
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=anchor.decode())
    context.set_alpn_protocols([ALPN])
    tls = await _connect(host, port, context, timeout, peer_id)
    if isinstance(tls, Probe):
        return tls
    tls.close()
    return Probe(True, True, peer_id)


async def _connect(host: str, port: int, context: ssl.SSLContext, timeout: float,
                   expected: str = "") -> ssl.SSLSocket | Probe:
    """The TLS socket of a completed handshake, or the `Probe` saying why there was none."""
    try:
        return await asyncio.wait_for(_handshake(host, port, context), timeout)
    except ssl.SSLCertVerificationError as e:  # only where `context` verifies (`prove`)
        return Probe(True, True, None, f"its certificate does not prove {expected} ({e.verify_message or e.reason})")
    except ssl.SSLError as e:
        return Probe(True, False, None, f"{type(e).__name__}: {e.reason or e}")
    except (ConnectionResetError, EOFError) as e:
        return Probe(True, False, None, f"{type(e).__name__}: {e}")
    except (OSError, TimeoutError) as e:
        return Probe(False, False, None, f"{type(e).__name__}: {e}")


async def _handshake(host: str, port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    """A TLS client handshake with `host:port` on a non-blocking socket, driven by the loop's
    readiness callbacks. Neither the loop's resolver nor its TLS transport is used for an address
    literal (`swarm.net.sockets`), and the server name is passed as bytes (`SERVER_NAME_BYTES`,
    which uvloop's transports refuse): a probe costs no `idna` codec and no resolver threads."""
    loop = asyncio.get_running_loop()
    sock = await connected_socket(host, port)
    try:
        tls = context.wrap_socket(sock, server_hostname=SERVER_NAME_BYTES, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    try:
        while True:
            try:
                tls.do_handshake()
                return tls
            except ssl.SSLWantReadError:
                await _ready(loop.add_reader, loop.remove_reader, tls.fileno())
            except ssl.SSLWantWriteError:
                await _ready(loop.add_writer, loop.remove_writer, tls.fileno())
    except BaseException:
        tls.close()
        raise


async def _ready(add: Callable[..., object], remove: Callable[[int], object], fd: int) -> None:
    """Waits until `fd` is readable (`loop.add_reader`) or writable (`loop.add_writer`)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)
