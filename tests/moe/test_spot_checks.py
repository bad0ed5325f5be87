"""Spot checks: a mixture compares an expert's answer with another server's of the same expert.

Real servers on loopback: honest ones hold identical copies of ``ffn.1`` (same seed, and the tests
only run forwards, so no copy trains apart), and a hostile one answers ``flip``: the honest answer
negated, finite, of the right shape and size, which the answer checks alone cannot see. ``ffn.0``
lives on an honest server of its own and keeps each batch above k_min=1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.core.errors import ConfigError
from swarm.moe import ExpertServer, ExpertServerConfig, RemoteMixtureOfExperts
from swarm.moe.client.dispatch import DispatchPolicy
from swarm.moe.client.mixture import MixtureConfig
from swarm.moe.client.spot_checks import SpotCheckConfig, answers_match
from swarm.moe.sources import StaticExpertSource

pytestmark = pytest.mark.timeout(90)
HID = 16


def serve(make_peer, uid: str, hostile: str | None = None) -> tuple[str, nn.Linear]:
    """A server of `uid` (weights seeded by the uid, so every server of it holds the same copy)."""
    torch.manual_seed(int(uid.split(".")[1]))
    module = nn.Linear(HID, HID)
    config = ExpertServerConfig(hostile=hostile, checkpoint_interval=None)
    server = ExpertServer(make_peer(), {uid: module}, config=config, declare=False)
    return server.peer.addrs[0], module


def mixture(make_peer, servers: list[tuple[str, str]], fraction: float = 1.0) -> RemoteMixtureOfExperts:
    config = MixtureConfig(in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2,
                           policy=DispatchPolicy(k_min=1), spot_checks=SpotCheckConfig(fraction=fraction, seed=0))
    moe = RemoteMixtureOfExperts(make_peer(client_mode=True), config, source=StaticExpertSource(servers))
    with torch.no_grad():
        moe.gate.weight.zero_()  # both experts weigh alike: the output is their mean
        moe.gate.bias.zero_()
    return moe


def mismatches_counted() -> float:
    from swarm.metrics import MOE_REJECTED_ANSWERS, REGISTRY

    assert MOE_REJECTED_ANSWERS is not None
    return REGISTRY.value("swarm_moe_rejected_answers_total", direction="forward", reason="mismatch") or 0.0


def test_two_answers_match_within_the_tolerance_row_by_row() -> None:
    a = torch.randn(6, 4)
    assert answers_match(a, a + 1e-4, 0.05)
    assert not answers_match(a, -a, 0.05)
    wrong_row = a.clone()
    wrong_row[3] *= 2
    assert not answers_match(a, wrong_row, 0.05), "one wrong row is a mismatch"
    assert not answers_match(a, torch.full_like(a, float("nan")), 0.05)
    assert not answers_match(a, a[:, :3], 0.05)
    with pytest.raises(ConfigError):
        SpotCheckConfig(fraction=1.5)
    assert SpotCheckConfig().fraction == 0.0, "off by default"


def test_without_spot_checks_a_flipping_server_passes_the_answer_checks(make_peer) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, m1 = serve(make_peer, "ffn.1", hostile="flip")
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar)], fraction=0.0)
    x = torch.randn(8, HID)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), (m0(x) - m1(x)) / 2, rtol=1e-5, atol=1e-6)
    assert moe.caller.misbehaviours == 0 and moe.caller.spot is None


def test_a_mismatch_between_two_servers_drops_the_answer_but_avoids_neither(make_peer) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, _ = serve(make_peer, "ffn.1", hostile="flip")
    honest1, _ = serve(make_peer, "ffn.1")
    # the liar is the server the mixture calls for ffn.1, the honest copy answers the spot check
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar), ("ffn.1", honest1)])
    before = mismatches_counted()
    x = torch.randn(8, HID)
    with torch.no_grad():
        y = moe(x)
    torch.testing.assert_close(y, m0(x).detach(), rtol=1e-5, atol=1e-6)  # ffn.1's answer was dropped
    spot = moe.caller.spot
    assert spot is not None and spot.checked == 1 and spot.mismatches == 1
    assert spot.evidence == {liar: 1, honest1: 1}, "both are involved; two servers cannot tell which one lies"
    assert moe.searcher.avoided_servers() == [] and mismatches_counted() - before == 1


def test_a_third_server_tells_which_one_lies_and_the_liar_is_avoided(make_peer) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, _ = serve(make_peer, "ffn.1", hostile="flip")
    honest1, m1 = serve(make_peer, "ffn.1")
    other1, _ = serve(make_peer, "ffn.1")
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar), ("ffn.1", honest1), ("ffn.1", other1)])
    x = torch.randn(8, HID)
    with torch.no_grad():
        y = moe(x)  # the two honest copies agree against the liar: its answer is dropped, it is avoided
    torch.testing.assert_close(y, m0(x).detach(), rtol=1e-5, atol=1e-6)
    assert moe.searcher.avoided_servers() == [liar]
    assert moe.caller.spot is not None and moe.caller.spot.mismatches == 1
    # an honest server the mixture calls, checked against either other copy (a seeded random choice):
    # its answer always stands, and the batch whose check meets the liar blames and avoids it
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", honest1), ("ffn.1", liar), ("ffn.1", other1)])
    for _ in range(8):
        with torch.no_grad():
            torch.testing.assert_close(moe(x), ((m0(x) + m1(x)) / 2).detach(), rtol=1e-5, atol=1e-6)
        if moe.searcher.avoided_servers():
            break
    assert moe.searcher.avoided_servers() == [liar]
    assert moe.caller.spot is not None and moe.caller.spot.evidence.get(other1) is None
