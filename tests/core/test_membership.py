"""Membership certificates, revocation lists and swarm keys, without sockets (docs/security.md,
"Private swarms"): every bad proof is refused with its own reason."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

from swarm.core.errors import ConfigError, IdentityError, PermissionDenied
from swarm.core.identity import Identity
from swarm.core.membership import (
    EXPIRED,
    FORGED,
    MALFORMED,
    MISSING,
    NOT_YET_VALID,
    REVOKED,
    UNKNOWN_ROLE,
    WRONG_AUTHORITY,
    WRONG_PEER_ID,
    WRONG_SWARM_KEY,
    Authority,
    CertificatePolicy,
    MembershipCertificate,
    MembershipRefused,
    RevocationList,
    SwarmKey,
    format_authority,
    parse_authority,
    parse_duration,
)

NOW = 1_800_000_000.0
DAY = 86400.0


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority.generate()


@pytest.fixture(scope="module")
def me() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def policy(authority: Authority, me: Identity) -> CertificatePolicy:
    return CertificatePolicy(authority.public_key, authority.invite(me.peer_id, ["trainer"], 30 * DAY, now=NOW))


def _refusal(policy: CertificatePolicy, peer_id: str, proof: bytes, now: float = NOW + 1) -> str:
    with pytest.raises(MembershipRefused) as caught:
        policy.check(peer_id, proof, now)
    assert isinstance(caught.value, PermissionDenied)
    assert caught.value.reason in str(caught.value)
    return caught.value.reason


def test_a_valid_certificate_gives_its_peer_its_roles(authority: Authority, policy: CertificatePolicy) -> None:
    other = Identity.generate()
    cert = authority.invite(other.peer_id, ["server", "trainer"], DAY, now=NOW)
    member = policy.check(other.peer_id, cert.encode(), NOW + 10)
    assert member.peer_id == other.peer_id and member.roles == {"server", "trainer"}
    assert member.has("server") and not member.has("relay")
    assert member.expires_at == NOW + DAY
    assert len(cert.encode()) < 200  # compact: it travels with every call's metadata


def test_the_text_form_round_trips(authority: Authority) -> None:
    peer = Identity.generate().peer_id
    cert = authority.invite(peer, ["relay"], DAY, now=NOW)
    assert MembershipCertificate.from_text(cert.to_text() + "\n") == cert
    assert parse_authority(authority.public_text) == authority.public_key
    assert parse_authority(authority.public_key.hex()) == authority.public_key
    assert format_authority(authority.public_key) == authority.public_text


def test_each_bad_certificate_is_refused_with_its_own_reason(authority: Authority, policy: CertificatePolicy) -> None:
    peer = Identity.generate().peer_id
    good = authority.invite(peer, ["trainer"], DAY, now=NOW)
    assert _refusal(policy, peer, b"") == MISSING
    assert _refusal(policy, peer, b"\x93garbage") == MALFORMED
    assert _refusal(policy, peer, b"\xff" * 5000) == MALFORMED
    assert _refusal(policy, peer, good.encode(), now=NOW + DAY) == EXPIRED
    assert _refusal(policy, peer, good.encode(), now=NOW - DAY) == NOT_YET_VALID
    assert _refusal(policy, Identity.generate().peer_id, good.encode()) == WRONG_PEER_ID
    stranger = Authority.generate().invite(peer, ["trainer"], DAY, now=NOW)
    assert _refusal(policy, peer, stranger.encode()) == WRONG_AUTHORITY
    # the same fields, re-signed by another key but claiming the swarm's authority: forged
    forged = MembershipCertificate(authority.public_key, peer, ("server",), good.issued_at, good.expires_at,
                                   good.serial, stranger.signature)
    assert _refusal(policy, peer, forged.encode()) == FORGED
    # a role added to a genuine certificate breaks its signature
    widened = MembershipCertificate(authority.public_key, peer, ("server", "trainer"), good.issued_at,
                                    good.expires_at, good.serial, good.signature)
    assert _refusal(policy, peer, widened.encode()) == FORGED
    # a later expiry too
    extended = MembershipCertificate(authority.public_key, peer, good.roles, good.issued_at,
                                     good.expires_at + 365 * int(DAY), good.serial, good.signature)
    assert _refusal(policy, peer, extended.encode()) == FORGED


def test_a_role_this_peer_does_not_know_is_refused(authority: Authority, policy: CertificatePolicy) -> None:
    peer = Identity.generate().peer_id
    with pytest.raises(ValueError, match="unknown role"):
        authority.invite(peer, ["admin"], DAY)
    # signed by the authority (a newer version's role), still refused by name, never ignored
    cert = MembershipCertificate(authority.public_key, peer, ("admin",), int(NOW), int(NOW + DAY), b"s", b"")
    cert = cert.signed(authority._key.sign(cert.payload()))
    assert _refusal(policy, peer, cert.encode()) == UNKNOWN_ROLE


def test_a_certificate_of_another_version_is_malformed(authority: Authority, policy: CertificatePolicy) -> None:
    peer = Identity.generate().peer_id
    fields = msgpack.unpackb(authority.invite(peer, ["trainer"], DAY, now=NOW).encode())
    fields[0] = 2
    assert _refusal(policy, peer, msgpack.packb(fields, use_bin_type=True)) == MALFORMED


def test_revocation_lists_revoke_by_peer_and_by_serial_and_only_newer_ones_count(authority: Authority, me: Identity) -> None:
    policy = CertificatePolicy(authority.public_key, authority.invite(me.peer_id, ["trainer"], DAY, now=NOW))
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    cert_a = authority.invite(a, ["trainer"], DAY, now=NOW)
    cert_b = authority.invite(b, ["trainer"], DAY, now=NOW)
    first = authority.revoke([a], now=NOW)
    decoded = RevocationList.decode(first.encode(), authority.public_key)
    assert decoded == first
    assert policy.apply(decoded)
    assert _refusal(policy, a, cert_a.encode()) == REVOKED
    policy.check(b, cert_b.encode(), NOW + 1)
    second = authority.revoke(serials=[cert_b.serial], previous=first, now=NOW + 5)
    assert second.number == 2 and a in second.peer_ids
    assert policy.apply(RevocationList.decode(second.encode(), authority.public_key))
    assert _refusal(policy, b, cert_b.encode()) == REVOKED
    assert _refusal(policy, a, cert_a.encode()) == REVOKED
    assert not policy.apply(first)  # an older list never undoes a newer one
    assert policy.revocations is not None and policy.revocations.number == 2


def test_a_forged_or_foreign_revocation_list_is_refused(authority: Authority) -> None:
    other = Authority.generate()
    foreign = other.revoke([Identity.generate().peer_id])
    with pytest.raises(MembershipRefused) as caught:
        RevocationList.decode(foreign.encode(), authority.public_key)
    assert caught.value.reason == WRONG_AUTHORITY
    genuine = authority.revoke([Identity.generate().peer_id])
    altered = RevocationList(authority.public_key, 99, genuine.issued_at, frozenset(), frozenset(), genuine.signature)
    with pytest.raises(MembershipRefused) as caught:
        RevocationList.decode(altered.encode(), authority.public_key)
    assert caught.value.reason == FORGED
    with pytest.raises(MembershipRefused) as caught:
        RevocationList.decode(b"\x01\x02", authority.public_key)
    assert caught.value.reason == MALFORMED


def test_a_peer_refuses_to_start_with_a_certificate_of_another_authority(authority: Authority, me: Identity) -> None:
    cert = Authority.generate().invite(me.peer_id, ["trainer"], DAY)
    with pytest.raises(ConfigError, match="another authority"):
        CertificatePolicy(authority.public_key, cert)


def test_authority_files_are_private_and_never_overwritten(tmp_path: Path, authority: Authority) -> None:
    path = tmp_path / "authority.key"
    authority.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert Authority.load(path).public_key == authority.public_key
    with pytest.raises(ConfigError, match="never overwritten"):
        authority.save(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        Authority.load(path)
    bad = tmp_path / "bad.key"
    bad.write_text("hello\n")
    os.chmod(bad, 0o600)
    with pytest.raises(ConfigError, match="not a swarm authority key"):
        Authority.load(bad)
    with pytest.raises(ConfigError, match="not a swarm authority public key"):
        parse_authority("swarm-authority:nope")


def test_swarm_key_proofs_are_bound_to_the_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    path.write_text(SwarmKey.generate_text())
    os.chmod(path, 0o600)
    key = SwarmKey.read(path)
    alice, bob = Identity.generate().peer_id, Identity.generate().peer_id
    mine, theirs = SwarmKey(key, alice), SwarmKey(key, bob)
    assert mine.check(bob, theirs.proof, NOW).roles == mine.own.roles
    for proof, peer, reason in [(b"", bob, MISSING), (b"x" * 36, bob, MALFORMED),
                                (theirs.proof, alice, WRONG_SWARM_KEY),
                                (SwarmKey(os.urandom(32), bob).proof, bob, WRONG_SWARM_KEY)]:
        with pytest.raises(MembershipRefused) as caught:
            mine.check(peer, proof, NOW)
        assert caught.value.reason == reason
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError):
        SwarmKey.read(path)


def test_durations() -> None:
    assert parse_duration("30d") == 30 * DAY
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration("90") == 90
    for bad in ("", "0d", "-1d", "3y", "d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
