"""Pure parts of overlapping rounds with compute, without sockets: the window moved aside while a
round is in flight, the fragments DiLoCo syncs in turn, the settings that bound staleness."""

from __future__ import annotations

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.optim import CollaborationConfig, DiLoCoConfig
from swarm.optim.accumulator import GradientAccumulator
from swarm.optim.diloco import DiLoCoMode, split_fragments


def test_a_window_in_flight_is_kept_apart_and_a_failed_one_folds_back():
    p = torch.nn.Parameter(torch.zeros(3))
    acc = GradientAccumulator([p])
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    acc.add(2)
    assert acc.begin_round() == 2.0 and torch.equal(acc.means[0], torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(RuntimeError):
        acc.begin_round()  # one round in flight at most
    p.grad = torch.tensor([3.0, 3.0, 3.0])
    acc.add(1)  # the next window, while the round averages
    assert acc.samples == 1 and torch.equal(acc.sums[0], torch.tensor([3.0, 3.0, 3.0]))
    acc.abort_round()  # the round failed: its samples are sent again with the next window
    assert acc.samples == 3 and torch.equal(acc.sums[0], torch.tensor([5.0, 7.0, 9.0]))
    assert acc.in_flight is None
    acc.begin_round()
    acc.in_flight_mean_to_grads()  # stepping alone uses the window's own mean, not the averaged buffer
    torch.testing.assert_close(p.grad, torch.tensor([5.0, 7.0, 9.0]) / 3)
    acc.end_round()
    assert acc.samples == 0 and acc.reset() == 0


def test_fragments_are_contiguous_non_empty_and_about_equal():
    assert split_fragments([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 1, 100], 4) == [[0], [1], [2], [3]]
    for sizes, count in (([3] * 10, 3), ([1, 50, 2, 2, 40, 5], 4), ([7], 1)):
        groups = split_fragments(sizes, count)
        assert len(groups) == count and all(groups)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
    with pytest.raises(ConfigError):
        split_fragments([1, 2], 3)


def test_diloco_rounds_sync_one_fragment_each_and_keep_the_steps_taken_meanwhile():
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    inner = torch.optim.SGD(params, lr=1.0)
    mode = DiLoCoMode(params, inner, None, DiLoCoConfig(local_steps=2, fragments=2, outer_lr=1.0,
                                                       outer_momentum=0.5, nesterov=False))
    assert [mode.fragment_of(e) for e in range(4)] == [0, 1, 0, 1]
    for p in params:
        p.grad = -torch.ones(4)  # each inner step adds 1
    mode.on_batch(1)
    assert mode.wants_round(None)  # steps_per_round = local_steps / fragments = 1
    mode.prepare_round(0)  # fragment 0: Δ = θ - x = -1
    mode.on_batch(1)  # an inner step while the round is in flight
    mode.apply_round(0)  # the (here unchanged) average lands: θ0 = 0 - 1 * (-1) = 1
    assert torch.equal(mode.outer_params[0].detach(), torch.ones(4))
    assert torch.equal(mode.outer_params[1].detach(), torch.zeros(4))  # the other fragment is untouched
    # x0 was 2 (two inner steps); it moves by θ_new - x_at_round_start = 1 - 1: the step taken meanwhile stays
    assert torch.equal(params[0].detach(), torch.full((4,), 2.0))
    assert torch.equal(params[1].detach(), torch.full((4,), 2.0))


def test_staleness_and_fragment_settings_are_checked():
    assert CollaborationConfig().max_staleness == 1
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ConfigError):
            CollaborationConfig(max_staleness=bad)
    assert DiLoCoConfig(local_steps=100, fragments=4).steps_per_round == 25
    for bad in ({"fragments": 0}, {"fragments": 3, "local_steps": 100}, {"fragments": True}):
        with pytest.raises(ConfigError):
            DiLoCoConfig(**bad)
