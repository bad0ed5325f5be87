"""Robust mode in the smallest groups (docs/architecture.md, "Robust averaging", small groups).

Two contributors cannot tell the liar from the honest one, so robust mode never aggregates fewer
than three: it forms groups of at least 3, and a round whose decision keeps fewer contributors
fails for every member alike with the tensors untouched. With three, one liar moves the result
by at most half the radius (plus the last step), whatever it sends.
"""

from __future__ import annotations

import math

import pytest
import torch
from avg_harness import run_steps

from swarm.averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig
from swarm.averaging.robust import MIN_CONTRIBUTORS, centered_clip, honest_bound
from swarm.core.errors import ConfigError
from swarm.peer import Peer

SIZE = 24_000
ROOMY = MatchmakingConfig(min_round_timeout=10.0)
ROBUST = AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip", chunk_bytes=16384), matchmaking=ROOMY)
PLAIN = AveragerConfig(allreduce=AllReduceConfig(chunk_bytes=16384), matchmaking=ROOMY)


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(SIZE, generator=gen)
    return [base + 0.1 * torch.randn(SIZE, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("kind", ["x1000", "sign_flip", "constant"])
def test_one_liar_of_three_moves_the_result_at_most_half_the_radius(kind):
    xs = _inputs(seed=5)
    liar = {"x1000": xs[2] * 1000, "sign_flip": -xs[2], "constant": torch.full((SIZE,), 3.0)}[kind]
    out = torch.empty(SIZE)
    outcome = centered_clip([xs[0], xs[1], liar], [1.0, 1.0, 1.0], out)
    honest_mean = (xs[0] + xs[1]) / 2
    # the automatic radius is the two honest inputs' distance: the liar is not what sets it
    assert outcome.tau == pytest.approx(float((xs[0] - xs[1]).norm()), rel=1e-5)
    assert outcome.scales[:2] == (1.0, 1.0) and outcome.scales[2] < 0.1
    assert float((out - honest_mean).norm()) <= honest_bound(1.0, 2.0, outcome.tau, outcome.step) * (1 + 1e-6)


def test_robust_mode_groups_at_least_three():
    peer = Peer()
    try:
        with pytest.raises(ConfigError, match="at least 3"):
            Averager(peer, [torch.zeros(4)], prefix="pair", target_group_size=2, config=ROBUST, initial_group=[])
        avg = Averager(peer, [torch.zeros(4)], prefix="four", target_group_size=4, min_group_size=2, config=ROBUST,
                       initial_group=[peer.addrs[0]])
        assert avg.config.matchmaking.min_group_size == MIN_CONTRIBUTORS
        avg.shutdown()
        plain = Averager(peer, [torch.zeros(4)], prefix="plain", target_group_size=2, config=PLAIN,
                         initial_group=[peer.addrs[0]])
        assert plain.config.matchmaking.min_group_size == 2
        plain.shutdown()
    finally:
        peer.shutdown()


@pytest.mark.timeout(60)
def test_a_robust_round_left_with_two_contributors_fails_for_all_and_a_plain_one_averages():
    # Three real peers, one listening only (weight 0): the decision keeps two contributors.
    peers = [Peer() for _ in range(3)]
    try:
        addrs = [p.addrs[0] for p in peers]
        inputs = _inputs(seed=9)
        for name, config in (("robust", ROBUST), ("plain", PLAIN)):
            tensors = [[x.clone()] for x in inputs]
            avgs = [Averager(p, t, prefix=f"two-{name}", target_group_size=3, initial_group=addrs, config=config)
                    for p, t in zip(peers, tensors)]
            try:
                results = run_steps(avgs, weights=[1.0, 1.0, 0.0], timeout=15.0)
            finally:
                for a in avgs:
                    a.shutdown()
            if name == "robust":
                for r in results:
                    assert isinstance(r, Exception) and "at least 3 contributors" in str(r), r
                assert all(torch.equal(t[0], x) for t, x in zip(tensors, inputs))
            else:
                assert all(not isinstance(r, Exception) for r in results), results
                mean = (inputs[0] + inputs[1]) / 2
                for t in tensors:
                    assert float((t[0] - mean).norm()) < 1e-4 * math.sqrt(SIZE)
    finally:
        for p in peers:
            p.shutdown()
