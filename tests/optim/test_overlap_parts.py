"""Pure parts of overlapping rounds with compute, without sockets: the window moved aside while a
round is in flight, the fragments DiLoCo syncs in turn, the settings that bound staleness."""

from __future__ import annotations

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.optim import CollaborationConfig, DiLoCoConfig
from swarm.optim.accumulator import GradientAccumulator
from swarm.optim.diloco import DiLoCoMode, split_fragments
from swarm.optim.large_batch import LargeBatchMode


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


def _trial_twins(trial: bool) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, LargeBatchMode]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 3))]
    adam = torch.optim.Adam(params, lr=0.1, betas=(0.9, 0.98))
    return params, adam, LargeBatchMode(params, adam, None, trial_step=trial)


def _batch(params: list[torch.nn.Parameter], seed: int) -> None:
    """A deterministic gradient that depends on where the parameters are (as a real batch's does)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = p.detach() * 0.5 + torch.randn(p.shape, generator=g)


def _optimizer_tensors(adam: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for state in adam.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def test_a_trial_step_moves_only_the_parameters_and_is_undone_bit_for_bit_when_the_average_lands():
    """With a round in flight, the trainer computes at the parameters moved by the optimizer's step
    on its own window; the optimizer's state is untouched, the shared parameters are what a newcomer
    downloads, and the landed step starts from them exactly: the epochs' parameters are bit for bit
    those of a peer that took no trial step, given the same averaged gradients."""
    with_trial, adam_t, mode_t = _trial_twins(True)
    without, adam_n, mode_n = _trial_twins(False)
    for epoch in range(3):
        for params, mode in ((with_trial, mode_t), (without, mode_n)):
            _batch(params, seed=epoch)
            mode.on_batch(4)
            mode.prepare_round(epoch)
        held = [p.detach().clone() for p in with_trial]
        state_before = _optimizer_tensors(adam_t)
        mode_t.overlap(epoch)
        mode_n.overlap(epoch)
        assert all(torch.equal(p, q) for p, q in zip(held, without))  # the twins agree on the shared state
        if epoch > 0:  # (Adam's first step has no state yet: the trial's step is its first)
            assert not any(torch.equal(p, h) for p, h in zip(with_trial, held))  # the trial moved them
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(adam_t), state_before))
        assert all(torch.equal(a, b) for a, b in zip(mode_t.shared_tensors, held))
        assert all(torch.equal(a, b) for a, b in zip(mode_t.state(epoch).params, held))
        # the same average lands on both (the group's mean; here each one's own window)
        for a, b in zip(mode_t.accumulator.means, mode_n.accumulator.means):
            assert torch.equal(a, b)
        mode_t.apply_round(epoch)
        mode_n.apply_round(epoch)
        assert all(torch.equal(p, q) for p, q in zip(with_trial, without))
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(adam_t), _optimizer_tensors(adam_n)))


def test_a_failed_or_lone_round_takes_back_the_trial_step():
    params, _, mode = _trial_twins(True)
    twin, _, twin_mode = _trial_twins(False)
    for ps, m in ((params, mode), (twin, twin_mode)):
        _batch(ps, seed=1)
        m.on_batch(2)
        m.prepare_round(0)
        m.overlap(0)
    mode.abort_round(0)  # the round failed: back to the shared parameters, the window kept
    twin_mode.abort_round(0)
    assert all(torch.equal(p, q) for p, q in zip(params, twin)) and mode.samples == 2
    for ps, m in ((params, mode), (twin, twin_mode)):
        m.prepare_round(0)
        m.overlap(0)
        m.step_alone(0)  # everyone else left: the window's own mean, from the shared parameters
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    _batch(params, seed=2)
    mode.on_batch(1)
    mode.prepare_round(1)
    mode.overlap(1)
    shared = [p.detach().clone() for p in mode.shared_tensors]
    assert mode.discard() == 1 and all(torch.equal(p, s) for p, s in zip(params, shared))
