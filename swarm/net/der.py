"""The two X.509 certificates swarm makes, and the leaf's P-256 key, encoded in DER by hand
(docs/security.md).

`cryptography.x509` builds them just as well, but importing it costs a DHT-only daemon ~3 MB of
its ~60 MB (its modules, and `email` which it pulls in; benchmarks/history/BENCHMARKS-2026-12-05.md "What a DHT-only daemon's
memory is"), and a daemon needs it at start-up (its own certificate) and for every peer it dials
(the trust anchor). Both certificates are fixed templates with a handful of fields, so they are
written here; `tests/net/test_der.py` checks that they are byte for byte what
`cryptography.x509.CertificateBuilder` makes from the same fields. The leaf's key (its
SubjectPublicKeyInfo, and the PKCS #8 PEM that `ssl` loads) is written here too, byte for byte
what `cryptography`'s `serialization` makes, whose import costs ~0.6 MB more. Reading a certificate received
from an unknown peer (`tls.read_peer_certificate`) still goes through `cryptography.x509`: parsing
untrusted DER is the library's job.
"""

from __future__ import annotations

import binascii
import datetime
from collections.abc import Callable, Sequence

ED25519 = "1.3.101.112"
COMMON_NAME = "2.5.4.3"
ORGANIZATION_NAME = "2.5.4.10"
KEY_USAGE = "2.5.29.15"
SUBJECT_ALT_NAME = "2.5.29.17"
BASIC_CONSTRAINTS = "2.5.29.19"

SEQUENCE, SET, INTEGER, BIT_STRING, OCTET_STRING, OID, BOOLEAN = 0x30, 0x31, 0x02, 0x03, 0x04, 0x06, 0x01
UTF8_STRING, UTC_TIME, GENERALIZED_TIME = 0x0C, 0x17, 0x18


def length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def tlv(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + length(len(body)) + body


def read(data: bytes, offset: int, tag: int) -> tuple[bytes, int]:
    """The body of the element with `tag` at `offset`, and the offset after it."""
    if offset + 2 > len(data) or data[offset] != tag:
        raise ValueError("unexpected DER tag")
    n, offset = data[offset + 1], offset + 2
    if n & 0x80:
        count = n & 0x7F
        if count == 0 or count > 4 or offset + count > len(data):
            raise ValueError("bad DER length")
        n, offset = int.from_bytes(data[offset:offset + count], "big"), offset + count
    if offset + n > len(data):
        raise ValueError("truncated DER")
    return data[offset:offset + n], offset + n


def oid(dotted: str) -> bytes:
    arcs = [int(a) for a in dotted.split(".")]
    body = bytearray()
    for arc in [40 * arcs[0] + arcs[1], *arcs[2:]]:
        chunk = [arc & 0x7F]
        while arc > 0x7F:
            arc >>= 7
            chunk.append(0x80 | (arc & 0x7F))
        body += bytes(reversed(chunk))
    return tlv(OID, bytes(body))


def integer(n: int) -> bytes:
    if n < 0:
        raise ValueError("only non-negative integers are encoded here")
    return tlv(INTEGER, n.to_bytes(n.bit_length() // 8 + 1, "big"))  # a leading 0 where the top bit is set


def time(when: datetime.datetime) -> bytes:
    """UTCTime up to 2049, GeneralizedTime from 2050 (RFC 5280, 4.1.2.5), to the second."""
    when = when.astimezone(datetime.UTC)
    if when.year < 2050:
        return tlv(UTC_TIME, when.strftime("%y%m%d%H%M%SZ").encode())
    return tlv(GENERALIZED_TIME, f"{when.year:04d}{when.strftime('%m%d%H%M%S')}Z".encode())


def name(attributes: Sequence[tuple[str, str]]) -> bytes:
    """A Name of one attribute per RDN, each a UTF8String, in the order given."""
    return tlv(SEQUENCE, b"".join(
        tlv(SET, tlv(SEQUENCE, oid(kind) + tlv(UTF8_STRING, value.encode()))) for kind, value in attributes))


def extension(kind: str, value: bytes, critical: bool) -> bytes:
    return tlv(SEQUENCE, oid(kind) + (tlv(BOOLEAN, b"\xff") if critical else b"") + tlv(OCTET_STRING, value))


def ed25519_spki(public_key: bytes) -> bytes:
    return tlv(SEQUENCE, tlv(SEQUENCE, oid(ED25519)) + tlv(BIT_STRING, b"\x00" + public_key))


EC_PUBLIC_KEY = "1.2.840.10045.2.1"
P256 = "1.2.840.10045.3.1.7"


def p256_spki(x: int, y: int) -> bytes:
    """SubjectPublicKeyInfo of the P-256 point (x, y), uncompressed (RFC 5480)."""
    return tlv(SEQUENCE, tlv(SEQUENCE, oid(EC_PUBLIC_KEY) + oid(P256)) + tlv(BIT_STRING, b"\x00" + _point(x, y)))


def p256_pkcs8(d: int, x: int, y: int) -> bytes:
    """PKCS #8 PrivateKeyInfo of the P-256 key with secret `d` and public point (x, y), laid out
    as OpenSSL writes it: the curve in the algorithm, the public point in the ECPrivateKey (RFC 5915)."""
    ec_private_key = tlv(SEQUENCE, integer(1) + tlv(OCTET_STRING, d.to_bytes(32, "big"))
                         + tlv(0xA1, tlv(BIT_STRING, b"\x00" + _point(x, y))))
    return tlv(SEQUENCE, integer(0) + tlv(SEQUENCE, oid(EC_PUBLIC_KEY) + oid(P256))
               + tlv(OCTET_STRING, ec_private_key))


def _point(x: int, y: int) -> bytes:
    return b"\x04" + x.to_bytes(32, "big") + y.to_bytes(32, "big")


def pem(label: str, der: bytes) -> bytes:
    """`der` in PEM: base64 in lines of 64 between BEGIN and END `label` lines (RFC 7468)."""
    text = binascii.b2a_base64(der, newline=False)
    lines = [text[i:i + 64] for i in range(0, len(text), 64)]
    return b"".join([f"-----BEGIN {label}-----\n".encode(), *(line + b"\n" for line in lines),
                     f"-----END {label}-----\n".encode()])


def basic_constraints(ca: bool, path_length: int | None = None) -> bytes:
    body = tlv(BOOLEAN, b"\xff") if ca else b""
    return tlv(SEQUENCE, body + (integer(path_length) if path_length is not None else b""))


KEY_CERT_SIGN_ONLY = tlv(BIT_STRING, bytes([2, 0x04]))  # KeyUsage: bit 5 (keyCertSign), 2 unused bits


def dns_names(*names: str) -> bytes:
    return tlv(SEQUENCE, b"".join(tlv(0x82, n.encode("ascii")) for n in names))  # [2] IMPLICIT IA5String


def certificate(*, serial: int, issuer: bytes, subject: bytes, not_before: datetime.datetime,
                not_after: datetime.datetime, spki: bytes, extensions: Sequence[bytes],
                sign: Callable[[bytes], bytes]) -> bytes:
    """An X.509 v3 certificate signed with Ed25519 (`sign` makes the signature over the TBS DER)."""
    algorithm = tlv(SEQUENCE, oid(ED25519))
    tbs = tlv(SEQUENCE, b"".join([
        tlv(0xA0, integer(2)),  # [0] EXPLICIT version: v3
        integer(serial), algorithm, issuer,
        tlv(SEQUENCE, time(not_before) + time(not_after)),
        subject, spki,
        tlv(0xA3, tlv(SEQUENCE, b"".join(extensions))),  # [3] EXPLICIT extensions
    ]))
    return tlv(SEQUENCE, tbs + algorithm + tlv(BIT_STRING, b"\x00" + sign(tbs)))
