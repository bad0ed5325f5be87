"""Checks of every expert answer a mixture receives, forward and backward, and the bound on each one's weight.

Experts are served by strangers (docs/threat-model.md, "Hostile experts"). Before a mixture uses an
answer it checks, per answer (one expert's outputs, or one server's summed input gradients):

1. the shape: the expert's outputs have the batch's rows and the shape every other expert of the
   layer answers with (`swarm.moe.client.dispatch`);
2. finiteness: any NaN or Inf rejects the answer;
3. magnitude, as a gain: each row's norm over the norm of what it answers (forward: the sample's
   input row, floored at the batch's median input row, so that a zero input cannot make a gain
   infinite; backward: the sum of the output-gradient row norms the server was sent for that
   sample). An answer's typical gain (the lower median over its rows) must be at most
   `AnswerChecks.reject_ratio` times the layer's reference, the lower median of the typical gains of
   the answers accepted before (`swarm.moe.magnitudes.NormReference`), kept apart for outputs and
   for gradients. Gains, unlike norms, do not care that some samples weigh a thousand times more
   than others: an honest expert maps them alike.

A rejected answer counts as that expert failing for the batch (like a timeout: `k_min` decides
whether the batch goes on), and its server is avoided for `AnswerChecks.avoid_for` seconds.

What is accepted is then clipped row by row to ``clip_ratio x reference`` gain. As a sample's gate
weights sum to at most 1, one expert moves a sample's combined output by at most
``clip_ratio x reference x max(|x_r|, median |x|)``, whatever it answers; a server moves a sample's
input gradient by at most ``clip_ratio x reference x`` the norms of the output gradients it was sent
for it.

A single `RemoteExpert` called directly gets the same checks (`ExpertGuard`): its outputs must fit
the schema the expert declared (Info) and its input gradients the inputs' shapes, all finite, and
its gains at most `reject_ratio` times the reference learned from its own accepted answers. There
is no k_min for one expert, so a failing answer raises `MisbehavingExpert` to the caller; nothing
is clipped (the caller gets exactly the expert's answer, or the error). Learned from the expert
alone, the magnitude bound catches an expert that changes its answers' scale (a liar that lies
sometimes, or turns); one that lies by the same factor from its first answer on is bounded only in
a mixture, where its answers are compared with other experts'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm.core.errors import ConfigError, InvalidRequest, MoEError
from swarm.moe.magnitudes import NormReference, row_norms, typical_norm
from swarm.moe.schema import TensorSchema

__all__ = ["AnswerChecks", "AnswerGuard", "ExpertGuard", "MisbehavingExpert", "Verdict", "count_event",
           "input_scale"]

logger = logging.getLogger(__name__)


class MisbehavingExpert(MoEError):
    """An expert's answer failed the mixture's checks (not finite, another shape, or far too large)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class AnswerChecks:
    """How a mixture judges its experts' answers.

    Attributes:
        enabled: check and clip answers (False: take any answer of the right shape, as it is).
        reject_ratio: an answer whose typical row norm exceeds this many times the reference is
            rejected.
        clip_ratio: each accepted row is scaled down to at most this many times the reference.
        window: how many accepted answers the reference is taken over (per layer and direction).
        avoid_for: seconds the server of a rejected answer is not chosen again.
        min_reference: a reference below this judges no magnitudes (answers of ~0 bound nothing).
    """

    enabled: bool = True
    reject_ratio: float = 100.0
    clip_ratio: float = 20.0
    window: int = 128
    avoid_for: float = 60.0
    min_reference: float = 1e-12

    def __post_init__(self) -> None:
        if not self.reject_ratio > 1 or not self.clip_ratio > 1:
            raise ConfigError("reject_ratio and clip_ratio must be greater than 1")
        if self.window < 1:
            raise ConfigError("window must be positive")
        if self.avoid_for < 0 or self.min_reference < 0:
            raise ConfigError("avoid_for and min_reference must be >= 0")


@dataclass(frozen=True)
class Verdict:
    """What the checks made of a batch's answers in one direction.

    Attributes:
        rejected: per answer, why it was rejected (None: accepted).
        reference: the magnitude they were judged against (None: nothing known yet).
        norms: per answer, its row norms.
    """

    rejected: list[str | None]
    reference: float | None
    norms: list[torch.Tensor]


class AnswerGuard:
    """The checks of one mixture layer: its references and counts (used on the calling thread).

    Args:
        checks: the thresholds.
    """

    def __init__(self, checks: AnswerChecks) -> None:
        self.checks = checks
        self.outputs = NormReference(checks.window)
        self.grads = NormReference(checks.window)
        self.rejected = 0
        """Answers rejected so far."""
        self.clipped_rows = 0
        """Rows scaled down so far (outputs and gradients)."""
        self.checked_rows = 0
        """Rows accepted and held against the clipping bound so far (outputs and gradients)."""

    def judge(
        self, answers: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], reference: NormReference
    ) -> Verdict:
        """Judges a batch's answers together; the accepted ones join `reference`.

        Args:
            answers: one tensor per answer, rows first.
            scales: per answer, what each of its rows is measured against (its gain's denominator);
                rows measured against 0 do not count in its typical gain.
            reference: `outputs` or `grads`.
        """
        typicals: list[float | None] = []
        all_norms = []
        for t, scale in zip(answers, scales):
            norms = row_norms(t)  # NaN/Inf anywhere in a row makes its norm so
            all_norms.append(norms)
            if not bool(torch.isfinite(norms).all()):
                typicals.append(None)
                continue
            measured = scale > 0
            typicals.append(typical_norm(norms[measured] / scale[measured]))
        ref = reference.reference(v for v in typicals if v is not None)
        judged = ref is not None and ref > self.checks.min_reference
        rejected: list[str | None] = []
        for typical in typicals:
            if typical is None:
                rejected.append("not_finite")
            elif judged and typical > self.checks.reject_ratio * ref:  # type: ignore[operator]
                rejected.append("magnitude")
            else:
                rejected.append(None)
                reference.add(typical)
        self.rejected += sum(r is not None for r in rejected)
        return Verdict(rejected, ref, all_norms)

    def clip_scales(self, norms: torch.Tensor, scales: torch.Tensor, reference: float | None) -> torch.Tensor | None:
        """Per row, the factor (<= 1) that brings its gain (`norms` over `scales`) within
        ``clip_ratio x reference``; None when no row needs it."""
        self.checked_rows += norms.numel()
        if reference is None or reference <= self.checks.min_reference:
            return None
        limit = self.checks.clip_ratio * reference * scales
        over = norms > limit
        if not bool(over.any()):
            return None
        self.clipped_rows += int(over.sum())
        return torch.where(over, limit / norms.clamp_min(1e-30), torch.ones_like(norms))


def count_event(what: str, direction: str, reason: str = "", rows: int = 1) -> None:
    """Updates the answer-check metrics: ``what`` is "rejected" (one answer, for `reason`) or
    "clipped" (`rows` rows). prometheus_client is loaded at the first event, not at import."""
    from swarm.metrics import MOE_CLIPPED_ROWS, MOE_REJECTED_ANSWERS

    if what == "rejected":
        MOE_REJECTED_ANSWERS.labels(direction=direction, reason=reason).inc()
    else:
        MOE_CLIPPED_ROWS.labels(direction=direction).inc(rows)


def input_scale(x: torch.Tensor) -> torch.Tensor:
    """Per sample, what its expert outputs are measured against: its input row's norm, floored at the
    batch's median (so that a zero row cannot make a gain infinite)."""
    norms = row_norms(x)
    return norms.clamp_min(max(typical_norm(norms), 1e-12))


def _joint_row_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per row, the norm of the row across all of `tensors` (each with the same rows)."""
    if len(tensors) == 1:
        return row_norms(tensors[0])
    return torch.stack([row_norms(t) for t in tensors]).square().sum(dim=0).sqrt()


class ExpertGuard:
    """The checks of one `RemoteExpert`'s answers, forward and backward.

    Args:
        checks: the thresholds (`clip_ratio` and `avoid_for` do not apply to a single expert).
        uid: the expert, as error messages name it.
    """

    def __init__(self, checks: AnswerChecks, uid: str) -> None:
        self.checks = checks
        self.uid = uid
        self.guard = AnswerGuard(checks)

    @property
    def rejected(self) -> int:
        """Answers rejected so far."""
        return self.guard.rejected

    def check_outputs(
        self, addr: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
        schemas: Sequence[TensorSchema],
    ) -> None:
        """Checks a forward's answer against the declared output schemas and the learned bound.

        Raises:
            MisbehavingExpert: another count, shape or dtype of outputs, NaN/Inf, or far too large.
        """
        if not self.checks.enabled:
            return
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else 0
        if len(outputs) != len(schemas):
            self._reject("forward", "shape", addr, f"answered {len(outputs)} outputs, its schema declares "
                         f"{len(schemas)}")
        for i, (out, schema) in enumerate(zip(outputs, schemas)):
            try:
                schema.validate(out, max(rows, 1), check_finite=False, what=f"output {i}")
            except InvalidRequest as e:
                self._reject("forward", "shape", addr, f"answered outside its declared schema: {e}")
            if out.shape[0] != rows:
                self._reject("forward", "shape", addr, f"answered {out.shape[0]} rows for {rows}")
        if rows == 0:  # no inputs or no rows: no output row to judge, nothing for the reference to learn
            return
        scale = input_scale(torch.cat([x.detach().reshape(rows, -1).float() for x in inputs], dim=1))
        self._judge("forward", addr, outputs, scale, self.guard.outputs)

    def check_grads(
        self, addr: str, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> None:
        """Checks a backward's answer: one gradient per input, of its shape and dtype, within bounds.

        Raises:
            MisbehavingExpert: another count, shape or dtype of gradients, NaN/Inf, or far too large.
        """
        if not self.checks.enabled:
            return
        if len(grads) != len(inputs) or any(g.shape != x.shape or g.dtype != x.dtype for g, x in zip(grads, inputs)):
            self._reject("backward", "shape", addr, f"answered gradients {[tuple(g.shape) for g in grads]} for "
                         f"inputs {[tuple(x.shape) for x in inputs]}")
        if not inputs or inputs[0].dim() == 0 or inputs[0].shape[0] == 0:
            return  # no rows: nothing to judge, nothing for the reference to learn
        if not grad_outputs:  # no gradient sent to measure gains against: finiteness alone is judged
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                self._reject("backward", "not_finite", addr, "answered NaN/Inf")
            return
        sent = torch.stack([row_norms(g) for g in grad_outputs]).sum(dim=0)
        self._judge("backward", addr, grads, sent, self.guard.grads)

    def _judge(self, direction: str, addr: str, answer: Sequence[torch.Tensor], scale: torch.Tensor,
               reference: NormReference) -> None:
        norms = _joint_row_norms(answer)
        verdict = self.guard.judge([norms.unsqueeze(1)], [scale], reference)
        reason = verdict.rejected[0]
        if reason == "not_finite":
            self._reject(direction, reason, addr, "answered NaN/Inf", counted=True)
        elif reason is not None:
            self._reject(direction, reason, addr, f"answered over {self.checks.reject_ratio:g}x the reference "
                         f"{verdict.reference:.3g} its own answers set", counted=True)

    def _reject(self, direction: str, reason: str, addr: str, what: str, counted: bool = False) -> None:
        if not counted:
            self.guard.rejected += 1
        count_event("rejected", direction, reason)
        error = MisbehavingExpert(f"expert {self.uid} at {addr}: {what} ({direction})", reason)
        logger.warning("%s: its answer is refused", error)
        raise error
