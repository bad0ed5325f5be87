"""The relay's scheduling and the NFQUEUE wire format, without sockets."""

import random
import struct

import pytest

from swarm.testing.lab import HostSpec, LinkProfile
from swarm.testing.nfqueue import (
    NF_ACCEPT,
    NFQNL_MSG_VERDICT_BATCH,
    PACKET_TYPE,
    parse_error,
    parse_packet,
    verdict_message,
)
from swarm.testing.relay import Channel


def test_a_packet_leaves_after_its_delay_and_not_before() -> None:
    ch = Channel(delay=0.05)
    rng = random.Random(0)
    assert ch.arrive(7, now=1.0, rng=rng)
    assert ch.due(1.049) is None
    assert ch.due(1.05) == 7
    assert ch.next_release() is None


def test_jitter_never_reorders_packets() -> None:
    ch = Channel(delay=0.05, jitter=0.04)
    rng = random.Random(1)
    for i in range(200):
        ch.arrive(i, now=i * 0.001, rng=rng)
    releases = [r for r, _ in ch.held]
    assert releases == sorted(releases)
    assert min(r - i * 0.001 for i, (r, _) in enumerate(ch.held)) >= 0.01 - 1e-9
    assert ch.due(10.0) == 199  # one batch verdict lets them all go


def test_loss_drops_about_the_fraction_asked_for() -> None:
    ch = Channel(delay=0.0, loss=0.2)
    rng = random.Random(2)
    kept = sum(ch.arrive(i, 0.0, rng) for i in range(10_000))
    assert ch.dropped == 10_000 - kept
    assert 1700 < ch.dropped < 2300


def test_bad_channel_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Channel(delay=-1)
    with pytest.raises(ValueError):
        Channel(loss=1.5)


def test_a_packet_message_is_parsed_at_fixed_offsets() -> None:
    attr = struct.pack("=HH", 11, 1) + struct.pack("!IHB", 4242, 0x0800, 0) + b"\0"
    body = struct.pack("!BBH", 2, 0, 9) + attr
    msg = struct.pack("=IHHII", 16 + len(body), PACKET_TYPE, 0, 0, 0) + body
    assert parse_packet(msg) == (9, 4242)
    assert parse_packet(msg[:20]) is None


def test_a_batch_verdict_names_the_queue_and_the_last_id() -> None:
    msg = verdict_message(5, 99, NF_ACCEPT, batch=True)
    length, kind = struct.unpack_from("=IH", msg)
    assert length == len(msg) == 32
    assert kind & 0xFF == NFQNL_MSG_VERDICT_BATCH
    assert struct.unpack_from("!H", msg, 18) == (5,)
    assert struct.unpack_from("!II", msg, 24) == (NF_ACCEPT, 99)


def test_an_error_message_gives_its_errno() -> None:
    msg = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -1) + b"\0" * 16
    assert parse_error(msg) == 1


def test_profiles_and_hosts_are_validated() -> None:
    with pytest.raises(ValueError):
        LinkProfile(up_mbit=0)
    with pytest.raises(ValueError):
        LinkProfile(loss=1.0)
    with pytest.raises(ValueError):
        HostSpec("Bad_Name")
    assert LinkProfile(delay_ms=1).shaped and not LinkProfile(up_mbit=10).shaped
