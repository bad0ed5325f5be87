"""Spot checks: a mixture compares an expert's answer with another server's of the same expert.

Real servers on loopback: honest ones hold identical copies of ``ffn.1`` (same seed, and the tests
only run forwards, so no copy trains apart), and a hostile one answers ``flip``: the honest answer
negated, finite, of the right shape and size, which the answer checks alone cannot see. ``ffn.0``
lives on an honest server of its own and keeps each batch above k_min=1.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from swarm.core.errors import ConfigError
from swarm.moe import ExpertServer, ExpertServerConfig, RemoteMixtureOfExperts
from swarm.moe.client.dispatch import DispatchPolicy
from swarm.moe.client.mixture import MixtureConfig
from swarm.moe.client.spot_checks import SpotCheckConfig, answers_match
from swarm.moe.schema import TensorSchema
from swarm.moe.sources import StaticExpertSource

pytestmark = pytest.mark.timeout(90)
HID = 16


def copy_of(uid: str) -> nn.Linear:
    """The expert `uid`'s parameters (seeded by the uid, so every server of it holds the same copy)."""
    torch.manual_seed(int(uid.split(".")[1]))
    return nn.Linear(HID, HID)


def serve(make_peer, uid: str, hostile: str | None = None) -> tuple[str, nn.Linear]:
    """A server of `uid`."""
    module = copy_of(uid)
    config = ExpertServerConfig(hostile=hostile, checkpoint_interval=None)
    server = ExpertServer(make_peer(), {uid: module}, config=config, declare=False)
    return server.peer.addrs[0], module


class Stalling(nn.Module):
    """An expert that, once `stall` is set, answers nothing until `release` is (or 60 s pass): a server
    that accepts calls and stays silent, as a hostile one or one whose machine froze."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.stall, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stall.is_set():
            self.release.wait(60.0)
        return self.inner(x)


def mixture(make_peer, servers: list[tuple[str, str]], fraction: float = 1.0,
            policy: DispatchPolicy | None = None, opinion_share: float = 0.25, seed: int = 0
            ) -> RemoteMixtureOfExperts:
    spot = SpotCheckConfig(fraction=fraction, seed=seed, opinion_share=opinion_share)
    config = MixtureConfig(in_features=HID, grid_size=(2,), uid_prefix="ffn.", k_best=2,
                           policy=policy or DispatchPolicy(k_min=1), spot_checks=spot)
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
    with pytest.raises(ConfigError):
        SpotCheckConfig(opinion_share=0.0)
    with pytest.raises(ConfigError, match="at least 2"):
        SpotCheckConfig(evidence_partners=1)  # one liar alone would frame whoever it contradicts


def test_without_spot_checks_a_flipping_server_passes_the_answer_checks(make_peer) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, m1 = serve(make_peer, "ffn.1", hostile="flip")
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar)], fraction=0.0)
    x = torch.randn(8, HID)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), (m0(x) - m1(x)) / 2, rtol=1e-5, atol=1e-6)
    assert moe.caller.misbehaviours == 0 and moe.caller.spot is None


def test_a_mismatch_between_two_servers_keeps_the_answer_and_avoids_neither(make_peer) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, m1 = serve(make_peer, "ffn.1", hostile="flip")
    honest1, _ = serve(make_peer, "ffn.1")
    # the liar is the server the mixture calls for ffn.1, the honest copy answers the spot check
    moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar), ("ffn.1", honest1)])
    before = mismatches_counted()
    x = torch.randn(8, HID)
    for _ in range(3):  # mismatches with the same partner, again and again, blame nobody
        with torch.no_grad():
            y = moe(x)
        # nothing tells which one lies: the answer the batch got (it passed the answer checks) stands
        torch.testing.assert_close(y, ((m0(x) - m1(x)) / 2).detach(), rtol=1e-5, atol=1e-6)
    spot = moe.caller.spot
    assert spot is not None and spot.checked == 3 and spot.mismatches == 3 and spot.blamed_on_evidence == 0
    assert spot.evidence == {liar: 3, honest1: 3}, "both are involved; two servers cannot tell which one lies"
    assert moe.searcher.avoided_servers() == [] and mismatches_counted() - before == 3
    assert moe.caller.misbehaviours == 0 and moe.caller.failures == 0


def test_a_liar_that_mismatches_two_distinct_servers_is_avoided_on_the_evidence(make_peer) -> None:
    # one liar serves both experts; each has one honest other server and no third to decide
    config = ExpertServerConfig(hostile="flip", checkpoint_interval=None)
    liar = ExpertServer(make_peer(), {"ffn.0": copy_of("ffn.0"), "ffn.1": copy_of("ffn.1")}, config=config,
                        declare=False).peer.addrs[0]
    honest0, m0 = serve(make_peer, "ffn.0")
    honest1, m1 = serve(make_peer, "ffn.1")
    moe = mixture(make_peer, [("ffn.0", liar), ("ffn.1", liar), ("ffn.0", honest0), ("ffn.1", honest1)])
    x = torch.randn(8, HID)
    with torch.no_grad():
        y = moe(x)
    spot = moe.caller.spot
    assert spot is not None and spot.mismatches == 2 and spot.blamed_on_evidence == 1
    assert spot.evidence == {liar: 2, honest0: 1, honest1: 1}
    # the first mismatch was undecided (its lie stands), the second gave the liar a second partner:
    # that answer is dropped and the liar avoided; each honest server met one partner and is not
    assert moe.searcher.avoided_servers() == [liar] and moe.caller.misbehaviours == 1
    kept = [-m(x).detach() for m in (m0, m1)]
    assert any(torch.allclose(y, k, rtol=1e-5, atol=1e-6) for k in kept), "one lie stood, the other was dropped"


def test_a_silent_second_or_third_server_holds_a_batch_at_most_the_opinion_deadline_then_is_avoided(
    make_peer,
) -> None:
    honest0, m0 = serve(make_peer, "ffn.0")
    liar, m1 = serve(make_peer, "ffn.1", hostile="flip")
    honest1, _ = serve(make_peer, "ffn.1")
    stalling = Stalling(copy_of("ffn.1"))
    silent = ExpertServer(make_peer(), {"ffn.1": stalling}, args_schema=[TensorSchema((HID,), torch.float32)],
                          config=ExpertServerConfig(checkpoint_interval=None), declare=False).peer.addrs[0]
    stalling.stall.set()
    # the forward deadline is long (a silent third used to hold a batch that long, and 5 s more; a
    # silent second that long); the opinions get 0.05 of it (3 s) beyond the batch's own calls
    policy = DispatchPolicy(k_min=1, forward_timeout=60.0)
    x = torch.randn(8, HID)
    honest_y, lying_y = m0(x).detach(), ((m0(x) - m1(x)) / 2).detach()
    try:
        # seed 1: the second opinion is honest1's, so the third is the silent server's
        moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", liar), ("ffn.1", honest1), ("ffn.1", silent)],
                      policy=policy, opinion_share=0.05, seed=1)
        started = time.monotonic()
        with torch.no_grad():
            y = moe(x)
        took = time.monotonic() - started
        spot = moe.caller.spot
        assert spot is not None and spot.evidence == {liar: 1, honest1: 1}
        assert took < 30.0, f"a silent third server held the batch {took:.1f} s"
        # no answer from the third is like a timeout: that server is avoided (not the expert, not the
        # others), and the mismatch is undecided: the batch's answer stands
        assert moe.searcher.avoided_servers() == [silent]
        torch.testing.assert_close(y, lying_y, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            moe(x)  # the next batch asks no one silent
        assert spot.mismatches == 2 and spot.evidence == {liar: 2, honest1: 2}

        # the silent server as the only other server of ffn.1: it is asked for the second opinion
        moe = mixture(make_peer, [("ffn.0", honest0), ("ffn.1", honest1), ("ffn.1", silent)], policy=policy,
                      opinion_share=0.05)
        started = time.monotonic()
        with torch.no_grad():
            y = moe(x)
        took = time.monotonic() - started
        assert took < 30.0, f"a silent second server held the batch {took:.1f} s"
        torch.testing.assert_close(y, (honest_y + m1(x).detach()) / 2, rtol=1e-5, atol=1e-6)
        assert moe.searcher.avoided_servers() == [silent]
        assert moe.caller.spot is not None and moe.caller.spot.checked == 0
    finally:
        stalling.release.set()


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
