"""Link estimates: RFC 6298 smoothing, long polls left out, deadlines between floor and cap (no sockets)."""

from __future__ import annotations

import math

import pytest

from swarm.net.estimates import LinkEstimates


def test_first_sample_then_rfc6298_smoothing():
    est = LinkEstimates()
    est.observe_rtt("a", 0.1)
    link = est.get("a")
    assert link is not None and link.srtt == pytest.approx(0.1) and link.rttvar == pytest.approx(0.05)
    est.observe_rtt("a", 0.2)
    # RTTVAR <- 3/4 RTTVAR + 1/4 |SRTT - R|, then SRTT <- 7/8 SRTT + 1/8 R (RFC 6298 §2.3)
    assert link.rttvar == pytest.approx(0.75 * 0.05 + 0.25 * 0.1)
    assert link.srtt == pytest.approx(0.875 * 0.1 + 0.125 * 0.2)
    assert link.min_rtt == pytest.approx(0.1) and link.samples == 2
    assert est.rtt("a") == pytest.approx(link.srtt)


def test_long_polls_and_bad_samples_are_not_round_trips():
    est = LinkEstimates()
    est.exclude("/x/Join")
    est.observe_call("a", "/x/Join", 30.0)
    est.observe_rtt("a", math.nan)
    est.observe_rtt("a", -1.0)
    est.observe_call("", "/x/Find", 0.01)  # a peer not known yet
    assert est.get("a") is None and est.rtt() is None
    est.observe_call("a", "/x/Find", 0.01)
    assert est.rtt("a") == pytest.approx(0.01)


def test_unmeasured_peer_falls_back_to_all_peers_then_to_the_default():
    est = LinkEstimates()
    assert est.retransmit_after("b", floor=0.02, cap=1.5) == 1.5
    assert est.retransmit_after("b", floor=0.02, cap=1.5, default=0.025) == 0.025
    est.observe_rtt("a", 0.1)
    # RTO = SRTT + 4 RTTVAR = 0.1 + 4 * 0.05
    assert est.retransmit_after("b", floor=0.02, cap=1.5) == pytest.approx(0.3)
    assert est.retransmit_after("a", floor=0.02, cap=0.2) == 0.2  # the existing setting caps it
    est.observe_rtt("c", 0.0001)
    assert est.retransmit_after("c", floor=0.02, cap=1.5) == 0.02  # the floor holds


def test_deadline_follows_rtt_and_throughput_within_floor_and_cap():
    est = LinkEstimates()
    assert est.deadline("a", 1 << 20, multiple=4, floor=0.5, cap=30.0) == 30.0  # never measured: the cap
    for _ in range(20):
        est.observe_rtt("a", 0.05)
    assert est.expected_time("a", 1 << 20) is None  # no throughput yet
    est.observe_transfer("a", 10_000_000, 1.05)  # 10 MB in 1 s past one round trip
    assert est.throughput("a") == pytest.approx(10_000_000 / 1.0)
    expected = est.expected_time("a", 5_000_000)
    assert expected is not None and 0.5 < expected < 0.6
    assert est.deadline("a", 5_000_000, multiple=4, floor=0.5, cap=30.0) == pytest.approx(4 * expected)
    assert est.deadline("a", 5_000_000, multiple=4, floor=0.5, cap=1.0) == 1.0
    # a slower link later: the estimate moves towards it
    for _ in range(20):
        est.observe_transfer("a", 1_000_000, 1.05)
    assert est.throughput("a") < 2_000_000


def test_forgets_the_least_recently_measured_peers_beyond_its_limit():
    est = LinkEstimates(max_peers=2)
    for peer in ("a", "b", "a", "c"):
        est.observe_rtt(peer, 0.01)
    assert set(est.links) == {"a", "c"}
