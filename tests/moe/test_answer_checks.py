"""The pure logic of the defences against hostile experts and clients, without sockets: the robust
reference, the client's verdicts and clipping, the server's gradient bound, the hostile fault modes."""

from __future__ import annotations

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.moe.client.answer_checks import AnswerChecks, AnswerGuard, ExpertGuard, MisbehavingExpert
from swarm.moe.magnitudes import NormReference, row_norms, typical_norm
from swarm.moe.schema import TensorSchema
from swarm.moe.server.config import ExpertServerConfig
from swarm.moe.server.gradient_bounds import GradientBound
from swarm.moe.server.hostile import HostileAnswers


def test_the_reference_is_the_lower_median_so_half_the_values_lying_cannot_move_it() -> None:
    reference = NormReference(window=8, settled=4)
    assert reference.reference() is None
    assert reference.reference([1.0, 1e6]) == 1.0  # one honest, one liar: the lower median is honest
    for value in (1.0, 1.1, 0.9, 1e6, 1e6, 1e6, 1.2, float("nan")):
        reference.add(value)  # NaN is ignored
    assert len(reference) == 7 and reference.reference([1e9]) == 1.2  # 3 liars of 7; settled: fresh values do not count
    assert typical_norm(torch.tensor([3.0, 1.0, 2.0, 100.0])) == 2.0
    torch.testing.assert_close(row_norms(torch.tensor([[3.0, 4.0], [0.0, 0.0]])), torch.tensor([5.0, 0.0]))


def test_the_guard_rejects_non_finite_and_oversized_answers_and_learns_only_from_the_accepted() -> None:
    guard = AnswerGuard(AnswerChecks(reject_ratio=10, clip_ratio=4))
    honest, liar, nan = torch.ones(4, 3), torch.ones(4, 3) * 1e6, torch.full((4, 3), float("nan"))
    ones = torch.ones(4)
    verdict = guard.judge([honest, liar, nan], [ones, ones, ones], guard.outputs)
    assert verdict.rejected == [None, "magnitude", "not_finite"] and guard.rejected == 2
    assert verdict.reference == pytest.approx(3**0.5) and len(guard.outputs) == 1
    # the judgement is a gain: rows that weigh 1000x more than the others, on inputs that do too, pass
    big_rows = torch.ones(4, 3)
    big_rows[0] *= 1000
    scale = torch.tensor([1000.0, 1, 1, 1])
    assert guard.judge([big_rows], [scale], guard.outputs).rejected == [None]
    scales = guard.clip_scales(row_norms(big_rows), scale, verdict.reference)
    assert scales is None  # within clip_ratio x the reference gain
    scales = guard.clip_scales(row_norms(big_rows), ones, verdict.reference)
    assert scales is not None and scales[1:].eq(1).all() and float(scales[0] * row_norms(big_rows)[0]) == pytest.approx(
        4 * 3**0.5)
    assert guard.clipped_rows == 1


def test_a_server_bounds_the_rows_of_huge_gradients_and_keeps_its_reference() -> None:
    bound = GradientBound(ratio=10, window=16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        bound.clip([torch.randn(32, 8, generator=gen)])
    assert bound.clipped_rows == 0
    (huge,) = bound.clip([torch.randn(32, 8, generator=gen) * 1e6])
    assert bound.clipped_rows == 32 and float(row_norms(huge).max()) < 10 * 4
    for _ in range(20):  # a flood of huge batches does not join the reference
        (huge,) = bound.clip([torch.randn(32, 8, generator=gen) * 1e6])
    assert float(row_norms(huge).max()) < 10 * 4
    honest = torch.randn(32, 8, generator=gen)
    assert torch.equal(bound.clip([honest])[0], honest)
    with pytest.raises(ValueError):
        GradientBound(ratio=1)


@pytest.mark.parametrize("mode", ["x1e6", "nan", "shape", "sometimes"])
def test_the_hostile_modes_lie_as_documented(mode: str) -> None:
    hostile = HostileAnswers(mode)
    t = torch.ones(2, 3)
    answers = [hostile.corrupt((t,))[0] for _ in range(3)]
    if mode == "x1e6":
        assert all(float(a.max()) == 1e6 for a in answers)
    elif mode == "nan":
        assert all(a.isnan().all() for a in answers)
    elif mode == "shape":
        assert all(a.shape == (2, 4) for a in answers)
    else:
        assert [float(a.max()) for a in answers] == [1.0, 1.0, 1e6]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        HostileAnswers("polite")
    with pytest.raises(ConfigError):
        ExpertServerConfig(hostile="polite")
    with pytest.raises(ConfigError):
        ExpertServerConfig(grad_clip_ratio=0.5)
    with pytest.raises(ConfigError):
        AnswerChecks(reject_ratio=1.0)


def test_a_single_experts_answer_without_rows_or_inputs_is_not_judged_by_magnitude() -> None:
    guard = ExpertGuard(AnswerChecks(), "ffn.0")
    # no rows, or no inputs at all: nothing to measure a gain against; the answer passes, unlearned
    guard.check_outputs("a", [torch.zeros(0, 4)], [], [])
    guard.check_outputs("a", [], [], [])
    guard.check_grads("a", [torch.zeros(0, 4)], [torch.zeros(0, 4)], [torch.zeros(0, 4)])
    guard.check_grads("a", [], [], [])
    guard.check_grads("a", [torch.ones(2, 4)], [], [torch.ones(2, 4)])  # no output gradient sent
    assert guard.rejected == 0 and len(guard.guard.outputs) == 0 and len(guard.guard.grads) == 0
    with pytest.raises(MisbehavingExpert, match="NaN/Inf"):  # finiteness is still judged
        guard.check_grads("a", [torch.ones(2, 4)], [], [torch.full((2, 4), float("nan"))])
    with pytest.raises(MisbehavingExpert, match="1 rows for 0"):  # and so is the shape
        guard.check_outputs("a", [], [torch.ones(1, 4)], [TensorSchema((4,), torch.float32)])
    # with rows, the magnitude is judged as before
    guard.check_outputs("a", [torch.ones(2, 4)], [torch.ones(2, 4)], [TensorSchema((4,), torch.float32)])
    assert len(guard.guard.outputs) == 1
