"""Tickets and handshakes, without sockets."""

import struct
import time

import pytest

from swarm.core.errors import Unauthenticated
from swarm.core.identity import Identity
from swarm.net.auth import (
    METADATA_KEY,
    TicketSigner,
    TicketVerifier,
    check_handshake,
    handshake_payload,
    make_ticket,
)

ALICE, BOB, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()


def md(ticket):
    return ((METADATA_KEY, ticket),)


def test_valid_ticket_names_the_caller_and_is_cached():
    verifier = TicketVerifier(BOB.peer_id)
    metadata = TicketSigner(ALICE).metadata_for(BOB.peer_id)
    assert verifier.caller_of(metadata) == ALICE.peer_id
    assert verifier.caller_of(metadata) == ALICE.peer_id


def test_missing_ticket_is_refused():
    with pytest.raises(Unauthenticated, match="no swarm ticket"):
        TicketVerifier(BOB.peer_id).caller_of((("other", b"x"),))


def test_ticket_for_another_callee_cannot_be_replayed():
    ticket_for_mallory = make_ticket(ALICE, MALLORY.peer_id)
    with pytest.raises(Unauthenticated, match="addressed to another peer"):
        TicketVerifier(BOB.peer_id).caller_of(md(ticket_for_mallory))


def test_ticket_claiming_another_key_fails_signature():
    # Mallory builds a ticket with Alice's public key but can only sign it with her own key.
    ticket = make_ticket(MALLORY, BOB.peer_id)
    forged = ticket[:4] + ALICE.public_key + ticket[36:]
    with pytest.raises(Unauthenticated, match="signature"):
        TicketVerifier(BOB.peer_id).caller_of(md(forged))


def test_tampered_and_malformed_tickets_are_refused():
    ticket = bytearray(make_ticket(ALICE, BOB.peer_id))
    ticket[40] ^= 1
    with pytest.raises(Unauthenticated):
        TicketVerifier(BOB.peer_id).caller_of(md(bytes(ticket)))
    for junk in (b"", b"SWT1", b"x" * 200):
        with pytest.raises(Unauthenticated, match="malformed"):
            TicketVerifier(BOB.peer_id).caller_of(md(junk))


def test_expired_ticket_is_refused():
    ticket = make_ticket(ALICE, BOB.peer_id, lifetime=-1000)
    with pytest.raises(Unauthenticated, match="expired"):
        TicketVerifier(BOB.peer_id).caller_of(md(ticket))


def test_handshake_proves_the_callee():
    challenge = b"c" * 32
    sig = BOB.sign(handshake_payload(challenge, ALICE.peer_id, BOB.peer_id))
    check_handshake(BOB.peer_id, BOB.public_key, sig, challenge, ALICE.peer_id)
    with pytest.raises(Unauthenticated, match="is not"):
        check_handshake(BOB.peer_id, MALLORY.public_key, sig, challenge, ALICE.peer_id)
    with pytest.raises(Unauthenticated, match="failed to prove"):
        check_handshake(BOB.peer_id, BOB.public_key, sig, b"d" * 32, ALICE.peer_id)
    # an impostor relaying Bob's answer made for someone else's challenge fails too
    with pytest.raises(Unauthenticated, match="failed to prove"):
        check_handshake(BOB.peer_id, BOB.public_key, sig, challenge, MALLORY.peer_id)


def test_ticket_layout_is_stable():
    ticket = make_ticket(ALICE, BOB.peer_id)
    magic, key, expiry, _nonce, _n = struct.unpack_from("!4s32sdQH", ticket)
    assert magic == b"SWT1" and key == ALICE.public_key and expiry > time.time()
