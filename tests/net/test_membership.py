"""The private swarm's gate without sockets: caching, throttling per address, revalidation after a
revocation, and roles per method."""

from __future__ import annotations

import pytest

from swarm.core.errors import PermissionDenied
from swarm.core.identity import Identity
from swarm.core.membership import Authority, CertificatePolicy, MembershipRefused
from swarm.net.membership import METADATA_KEY, THROTTLED, GateConfig, MembershipGate, address_of

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup() -> tuple[Authority, MembershipGate, Clock, CertificatePolicy]:
    authority = Authority.generate()
    me = Identity.generate()
    policy = CertificatePolicy(authority.public_key, authority.invite(me.peer_id, ["trainer"], 3600, now=NOW))
    clock = Clock()
    gate = MembershipGate(policy, GateConfig(max_refusals=3, refusal_window=60), clock,
                          caller_roles={"/swarm.Averaging/": frozenset({"trainer"})},
                          callee_roles={"/swarm.moe.Expert/": frozenset({"server"})})
    return authority, gate, clock, policy


def test_a_member_is_verified_once_and_expires_on_time(setup: tuple[Authority, MembershipGate, Clock, CertificatePolicy]) -> None:
    authority, gate, clock, _ = setup
    peer = Identity.generate().peer_id
    proof = authority.invite(peer, ["trainer"], 100, now=NOW).encode()
    metadata = ((METADATA_KEY, proof),)
    assert gate.admit(peer, metadata, "10.0.0.1").peer_id == peer
    assert gate.member(peer) is not None
    clock.now += 100
    with pytest.raises(MembershipRefused, match="expired"):
        gate.admit(peer, metadata, "10.0.0.1")
    assert gate.member(peer) is None


def test_a_thief_gets_nothing_from_a_cached_proof(setup: tuple[Authority, MembershipGate, Clock, CertificatePolicy]) -> None:
    authority, gate, _, _ = setup
    owner, thief = Identity.generate().peer_id, Identity.generate().peer_id
    metadata = ((METADATA_KEY, authority.invite(owner, ["trainer"], 100, now=NOW).encode()),)
    gate.admit(owner, metadata, "10.0.0.1")  # cached for its owner
    with pytest.raises(MembershipRefused, match="wrong PeerID"):
        gate.admit(thief, metadata, "10.0.0.2")


def test_an_address_is_throttled_but_a_member_behind_it_still_passes(setup: tuple[Authority, MembershipGate, Clock, CertificatePolicy]) -> None:
    authority, gate, clock, _ = setup
    for _ in range(3):
        with pytest.raises(MembershipRefused, match="missing"):
            gate.admit(Identity.generate().peer_id, (), "10.0.0.9")
    with pytest.raises(PermissionDenied, match=THROTTLED):
        gate.admit(Identity.generate().peer_id, (), "10.0.0.9")
    with pytest.raises(MembershipRefused, match="missing"):  # another address is not affected
        gate.admit(Identity.generate().peer_id, (), "10.0.0.10")
    member = Identity.generate().peer_id
    assert gate.admit(member, ((METADATA_KEY, authority.invite(member, ["trainer"], 100, now=NOW).encode()),),
                      "10.0.0.9").peer_id == member
    clock.now += 61  # the window passed
    with pytest.raises(MembershipRefused, match="missing"):
        gate.admit(Identity.generate().peer_id, (), "10.0.0.9")
    assert gate.refused[THROTTLED] == 1


def test_revalidation_cuts_off_revoked_members_and_tells_listeners(setup: tuple[Authority, MembershipGate, Clock, CertificatePolicy]) -> None:
    authority, gate, _, policy = setup
    keep, drop = Identity.generate().peer_id, Identity.generate().peer_id
    proofs = {p: ((METADATA_KEY, authority.invite(p, ["trainer"], 100, now=NOW).encode()),) for p in (keep, drop)}
    for peer, metadata in proofs.items():
        gate.admit(peer, metadata, "10.0.0.1")
    told: list[set[str]] = []
    gate.on_revoked.append(told.append)
    assert policy.apply(authority.revoke([drop], now=NOW))
    assert gate.revalidate() == {drop} and told == [{drop}]
    assert gate.member(drop) is None and gate.member(keep) is not None
    with pytest.raises(PermissionDenied, match="no longer a member"):
        gate.still_member(drop)
    with pytest.raises(MembershipRefused, match="revoked"):
        gate.admit(drop, proofs[drop], "10.0.0.1")


def test_roles_are_checked_per_method_on_both_sides(setup: tuple[Authority, MembershipGate, Clock, CertificatePolicy]) -> None:
    authority, gate, _, _ = setup
    observer = Identity.generate().peer_id
    metadata = ((METADATA_KEY, authority.invite(observer, ["observer"], 100, now=NOW).encode()),)
    assert gate.admit(observer, metadata, "10.0.0.1", "/swarm.DHT/Find").peer_id == observer
    with pytest.raises(PermissionDenied, match="lacks the role trainer"):
        gate.admit(observer, metadata, "10.0.0.1", "/swarm.Averaging/Join")
    member = gate.member(observer)
    assert member is not None
    with pytest.raises(PermissionDenied, match="lacks the role server"):
        gate.require_callee(member, "/swarm.moe.Expert/Forward")
    gate.require_callee(member, "/swarm.DHT/Find")


def test_addresses_of_grpc_peers() -> None:
    assert address_of("ipv4:10.1.2.3:5000") == "10.1.2.3"
    assert address_of("ipv6:[2001:db8::1]:5000") == "2001:db8::1"
