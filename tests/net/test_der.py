"""The certificates written by hand (`swarm.net.der`) are byte for byte what
`cryptography.x509.CertificateBuilder` makes from the same fields, and read back as such.

Ed25519 signatures are deterministic, so the same fields and key give the same bytes. No sockets.
"""

from __future__ import annotations

import datetime
import random
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from swarm.core.errors import Unauthenticated
from swarm.core.identity import Identity
from swarm.net import der, tls

DER = serialization.Encoding.DER


def _library_leaf(identity: Identity, key: ec.EllipticCurvePrivateKey, serial: int,
                  not_before: datetime.datetime, not_after: datetime.datetime) -> bytes:
    spki = key.public_key().public_bytes(DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)]))
        .issuer_name(tls.anchor_name(identity.public_key))
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(tls.SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.UnrecognizedExtension(tls.LIBP2P_EXTENSION_OID, tls.signed_key(identity, spki)),
                       critical=False)
        .sign(identity.private_key, None)
    ).public_bytes(DER)


def _hand_leaf(identity: Identity, key: ec.EllipticCurvePrivateKey, serial: int,
               not_before: datetime.datetime, not_after: datetime.datetime) -> bytes:
    spki = key.public_key().public_bytes(DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der.certificate(
        serial=serial, issuer=tls._anchor_name_der(identity.public_key),
        subject=der.name([(der.COMMON_NAME, identity.peer_id)]),
        not_before=not_before, not_after=not_after, spki=spki,
        extensions=[der.extension(der.SUBJECT_ALT_NAME, der.dns_names(tls.SERVER_NAME), critical=False),
                    der.extension(der.BASIC_CONSTRAINTS, der.basic_constraints(ca=False), critical=True),
                    der.extension("1.3.6.1.4.1.53594.1.1", tls.signed_key(identity, spki), critical=False)],
        sign=identity.sign)


@pytest.mark.parametrize("serial", [1, 127, 128, 255, 256, (1 << 159) - 1, 1 << 158])
@pytest.mark.parametrize("not_after_year", [2027, 2049, 2050, 9999])
def test_a_leaf_written_by_hand_is_the_librarys_byte_for_byte(serial, not_after_year):
    identity = Identity.generate()
    key = ec.generate_private_key(ec.SECP256R1())
    not_before = datetime.datetime(2026, 12, 1, 23, 59, 7, tzinfo=datetime.UTC)
    not_after = datetime.datetime(not_after_year, 12, 31, 0, 0, 1, tzinfo=datetime.UTC)
    assert _hand_leaf(identity, key, serial, not_before, not_after) == \
        _library_leaf(identity, key, serial, not_before, not_after)


def test_the_trust_anchor_written_by_hand_is_the_librarys_byte_for_byte():
    identity = Identity.generate()
    name = tls.anchor_name(identity.public_key)
    library = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(ed25519.Ed25519PublicKey.from_public_bytes(identity.public_key))
        .serial_number(1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(tls._anchor_signer(), None)
    ).public_bytes(DER)
    assert ssl.PEM_cert_to_DER_cert(tls.trust_anchor(identity.peer_id).decode()) == library


def test_a_peers_own_certificate_proves_its_peer_id_and_nothing_else():
    identity = Identity.generate()
    issued = tls.PeerCertificate.issue(identity)
    certificate = x509.load_pem_x509_certificate(issued.certificate_pem)
    assert tls.read_peer_certificate(certificate.public_bytes(DER)) == identity.peer_id
    assert certificate.issuer == tls.anchor_name(identity.public_key)
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == identity.peer_id
    assert certificate.serial_number > 0
    lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
    assert lifetime == datetime.timedelta(days=31)  # 30 days ahead, one back for clock skew
    key = serialization.load_pem_private_key(issued.key_pem, None)
    assert key.public_key() == certificate.public_key()

    tampered = bytearray(certificate.public_bytes(DER))
    tampered[tampered.index(identity.peer_id.encode())] ^= 1  # the subject, under the X.509 signature
    with pytest.raises(Unauthenticated, match="does not prove a libp2p identity"):
        tls.read_peer_certificate(bytes(tampered))


@pytest.mark.parametrize("dotted, encoded", [
    ("1.3.101.112", "06032b6570"),
    ("2.5.29.17", "0603551d11"),
    ("1.3.6.1.4.1.53594.1.1", "060a2b0601040183a25a0101"),
])
def test_object_identifiers_encode_as_in_x690(dotted, encoded):
    assert der.oid(dotted).hex() == encoded
    assert x509.ObjectIdentifier(dotted).dotted_string == dotted


def test_negative_integers_are_refused():
    with pytest.raises(ValueError):
        der.integer(-1)


P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_SECRETS = random.Random(7)


@pytest.mark.parametrize("d", [1, 2**200 + 7, 0xFF << 240,
                               *(_SECRETS.getrandbits(256) % (P256_ORDER - 1) + 1 for _ in range(24))])
def test_the_leafs_p256_key_is_byte_for_byte_what_the_library_writes(d):
    # small secrets and points with leading zero bytes check the fixed 32-byte fields
    key = ec.derive_private_key(d, ec.SECP256R1())
    point = key.public_key().public_numbers()
    assert der.p256_spki(point.x, point.y) == key.public_key().public_bytes(
        DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert der.pem("PRIVATE KEY", der.p256_pkcs8(d, point.x, point.y)) == key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.mark.parametrize("size", [1, 47, 48, 49, 96, 500])
def test_pem_lines_are_what_ssl_writes(size):
    data = bytes(range(256)) * 2
    assert der.pem("CERTIFICATE", data[:size]) == ssl.DER_cert_to_PEM_cert(data[:size]).encode()


def test_an_issued_leaf_key_loads_and_matches_its_certificate():
    certificate = tls.PeerCertificate.issue(Identity.generate())
    key = serialization.load_pem_private_key(certificate.key_pem, None)
    leaf = x509.load_pem_x509_certificate(certificate.certificate_pem)
    assert key.public_key().public_numbers() == leaf.public_key().public_numbers()
