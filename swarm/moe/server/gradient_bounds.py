"""The bound an expert puts on the gradients its callers send before it trains on them.

Experts train on whatever output gradients their callers send (`swarm.moe.server.backend`): the
server already refuses NaN/Inf (`ExpertServerConfig.check_finite`); this bounds magnitudes too, so
that a hostile client sending gradients x1e6 cannot wreck an honest expert's parameters, and the
expert keeps training. Each row of a batch's output gradients (one sample of one caller) whose norm
exceeds `ratio` times the expert's reference is scaled down to it. The reference is the lower median
of the typical row norms of the last `window` batches (`swarm.moe.magnitudes.NormReference`); a batch
whose typical row exceeds the bound does not join it, so liars, however many of their batches come,
do not move it. What it costs: an honest row is scaled only when it weighs over `ratio` times the
typical row of the expert's recent batches.

Until the expert has trained on a few batches (`NormReference.settled`) the reference is taken with
the batch being judged: an expert whose very first batches come from one hostile client learns its
reference from them (docs/threat-model.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.moe.magnitudes import NormReference, row_norms, typical_norm

__all__ = ["GradientBound"]


class GradientBound:
    """Clips the rows of one expert's output gradients to ``ratio x`` its running reference.

    Args:
        ratio: how many times the reference a row may weigh (> 1).
        window: batches the reference is taken over.

    Raises:
        ValueError: `ratio` <= 1 or `window` < 1.
    """

    def __init__(self, ratio: float = 10.0, window: int = 128) -> None:
        if not ratio > 1:
            raise ValueError(f"ratio must be greater than 1, got {ratio}")
        self.ratio = ratio
        self.window = window
        self._references: list[NormReference] = []
        self.clipped_rows = 0
        """Rows scaled down so far."""

    def clip(self, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Returns `grads` (one per output) with their rows over the bound scaled down to it."""
        while len(self._references) < len(grads):
            self._references.append(NormReference(self.window))
        return tuple(self._clip(g, reference) for g, reference in zip(grads, self._references))

    def _clip(self, g: torch.Tensor, reference: NormReference) -> torch.Tensor:
        if not g.is_floating_point() or g.dim() == 0 or g.shape[0] == 0:
            return g
        norms = row_norms(g)
        typical = typical_norm(norms)
        ref = reference.reference([typical])
        if ref is None or ref <= 0:
            reference.add(typical)
            return g
        limit = self.ratio * ref
        if typical <= limit:
            reference.add(typical)
        over = norms > limit
        if not bool(over.any()):
            return g
        self.clipped_rows += int(over.sum())
        scales = torch.where(over, limit / norms.clamp_min(1e-30), torch.ones_like(norms))
        return g * scales.view(-1, *([1] * (g.dim() - 1))).to(g.dtype)
