"""The demo's byzantine trainers: what each attack makes of a gradient (no sockets)."""

from __future__ import annotations

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.demo.byzantine import ATTACKS, attack_gradients
from swarm.demo.launcher import DemoConfig, build_parser


def _param(values: list[float]) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    return p


@pytest.mark.parametrize("kind", ATTACKS)
def test_each_attack_replaces_the_gradient_at_a_thousand_times_its_scale(kind):
    p = _param([0.3, -0.4, 0.0, 0.5])
    honest = p.grad.clone()
    attack_gradients([p], kind, torch.Generator().manual_seed(0))
    rms = float(honest.pow(2).mean().sqrt())
    assert float(p.grad.pow(2).mean().sqrt()) > 100 * rms
    if kind == "x1000":
        assert torch.allclose(p.grad, honest * 1000)
    if kind == "sign_flip":
        assert torch.allclose(p.grad, honest * -1000)
    if kind == "constant":
        assert torch.all(p.grad == p.grad[0])


def test_unknown_attacks_and_counts_are_refused():
    with pytest.raises(ValueError, match="unknown attack"):
        attack_gradients([_param([1.0])], "nice", torch.Generator())
    with pytest.raises(ConfigError, match="byzantine"):
        DemoConfig(trainers=3, byzantine=4)
    args = build_parser().parse_args(["--trainers", "8", "--byzantine", "2", "--attack", "random",
                                      "--aggregation", "centered_clip"])
    assert (args.byzantine, args.attack, args.aggregation) == (2, "random", "centered_clip")
