"""CenteredClip without sockets: convergence, weights, the bound of swarm/averaging/robust.py, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.averaging.robust import centered_clip, coordinate_median, honest_bound


def _honest(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=gen)
    return [base + 0.1 * torch.randn(size, generator=gen) for _ in range(n)]


def _mean(xs: list[torch.Tensor], ws: list[float]) -> torch.Tensor:
    return sum(w * x for w, x in zip(ws, xs)) / sum(ws)


ATTACKS = {
    "x1000": lambda honest, i: honest[i] * 1000,
    "sign_flip": lambda honest, i: -honest[i] * 10,
    "random": lambda honest, i: torch.randn(honest[0].numel(), generator=torch.Generator().manual_seed(99 + i)) * 100,
    "constant": lambda honest, i: torch.full_like(honest[0], 50.0),
}


def test_without_outliers_it_is_the_weighted_mean():
    xs = _honest(8, 1000)
    ws = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 0.5, 1.0]
    out = torch.empty(1000)
    outcome = centered_clip(xs, ws, out)
    assert all(c == 1.0 for c in outcome.scales)
    assert torch.allclose(out, _mean(xs, ws), atol=1e-5)
    assert math.isclose(sum(outcome.coefficients), 1.0, rel_tol=1e-9)
    assert outcome.coefficients[3] == pytest.approx(3 * outcome.coefficients[0])


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("n_bad", [1, 2])
def test_byzantine_inputs_move_the_result_at_most_the_bound(attack, n_bad):
    honest = _honest(8, 4000, seed=n_bad)
    xs = list(honest)
    for i in range(n_bad):
        xs[i] = ATTACKS[attack](honest, i)
    ws = [1.0] * 8
    out = torch.empty(4000)
    outcome = centered_clip(xs, ws, out)
    assert outcome.converged
    honest_mean = _mean(honest[n_bad:], ws[n_bad:])
    assert all(c == 1.0 for c in outcome.scales[n_bad:]), outcome.scales  # honest ones within tau
    error = float((out - honest_mean).norm())
    bound = honest_bound(n_bad, 8 - n_bad, outcome.tau, outcome.step)
    assert error <= bound * (1 + 1e-4), (error, bound)
    plain = _mean(xs, ws)
    assert float((plain - honest_mean).norm()) > 10 * bound  # the mean is moved far further
    assert all(c < 0.5 for c in outcome.scales[:n_bad])


def test_weights_respected_a_heavy_honest_input_pulls_more():
    xs = [torch.zeros(100), torch.ones(100) * 0.01]
    out = torch.empty(100)
    centered_clip(xs, [3.0, 1.0], out, tau=10.0)
    assert torch.allclose(out, torch.full((100,), 0.0025))
    outcome = centered_clip(xs, [0.0, 1.0], out)
    assert torch.equal(out, xs[1]) and outcome.coefficients == (0.0, 1.0)


def test_an_outlier_far_away_pulls_by_at_most_tau_times_its_share():
    xs = [torch.zeros(10) for _ in range(3)] + [torch.full((10,), 1e6)]
    out = torch.empty(10)
    outcome = centered_clip(xs, [1.0] * 4, out, tau=1.0)
    assert outcome.scales[3] < 1e-5
    assert float(out.norm()) <= 1 / 3 * (1.0 + outcome.step) + 1e-6


def test_iterations_are_bounded():
    xs = _honest(4, 100) + [torch.full((100,), 1e3)]
    out = torch.empty(100)
    outcome = centered_clip(xs, [1.0] * 5, out, tau=1e-6, max_iterations=3)
    assert outcome.iterations == 3 and not outcome.converged
    assert torch.isfinite(out).all()


def test_identical_and_empty_inputs():
    xs = [torch.ones(50) for _ in range(3)]
    out = torch.empty(50)
    outcome = centered_clip(xs, [1.0] * 3, out)
    assert torch.equal(out, xs[0]) and outcome.scales == (1.0, 1.0, 1.0)
    empty = [torch.empty(0) for _ in range(2)]
    outcome = centered_clip(empty, [1.0, 3.0], torch.empty(0))
    assert outcome.coefficients == (0.25, 0.75)


def test_bad_inputs_are_refused_with_a_clear_error():
    out = torch.empty(10)
    with pytest.raises(ValueError, match="at least one"):
        centered_clip([], [], out)
    bad = torch.zeros(10)
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        centered_clip([torch.zeros(10), bad], [1.0, 1.0], out)
    inf = torch.zeros(10)
    inf[0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        centered_clip([inf], [1.0], out)
    with pytest.raises(ValueError, match="weights"):
        centered_clip([torch.zeros(10)], [float("nan")], out)
    with pytest.raises(ValueError, match="weights"):
        centered_clip([torch.zeros(10)], [0.0], out)
    with pytest.raises(ValueError, match="equal length"):
        centered_clip([torch.zeros(10), torch.zeros(9)], [1.0, 1.0], out)
    with pytest.raises(ValueError, match="tau"):
        centered_clip([torch.zeros(10)], [1.0], out, tau=-1.0)


def test_coordinate_median_in_blocks():
    xs = [torch.arange(70_000, dtype=torch.float32) * k for k in (1.0, 3.0, 2.0)]
    out = coordinate_median(xs, torch.empty(70_000))
    assert torch.equal(out, xs[2])
