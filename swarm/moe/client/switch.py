"""RemoteSwitchMixtureOfExperts: switch-style routing (each sample to its top-1 live expert).

As in the Switch Transformer (Fedus et al. 2021, §2.1-2.2): the output is the chosen expert's
output scaled by its router probability (not renormalized), and an auxiliary load-balancing loss
pushes the router to spread samples evenly. On a grid, an expert's router probability is the
product of one softmax per grid dimension (the softmax of a sum of per-dimension scores
factorizes), so the loss is taken per dimension: ``g_d * sum_c f_d[c] * P_d[c]``, where
``f_d[c]`` is the fraction of samples routed to coordinate ``c`` of dimension ``d`` and
``P_d[c]`` the mean router probability of that coordinate; it is 1 per dimension when balanced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.dht.handle import PeerHandle
from swarm.moe.client.answer_checks import AnswerChecks
from swarm.moe.client.beam_search import ExpertChoice
from swarm.moe.client.mixture import RemoteMixtureOfExperts
from swarm.moe.sources import ExpertSource

__all__ = ["RemoteSwitchMixtureOfExperts"]


class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """A mixture that routes each sample to its best live expert; returns ``(output, balancing_loss)``.

    Takes the arguments of `RemoteMixtureOfExperts`, with ``k_best=1`` by default. With a
    larger `k_best`, every chosen expert that answered contributes, each scaled by its own
    router probability.
    """

    def __init__(
        self,
        peer: PeerHandle,
        *,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        k_best: int = 1,
        k_min: int = 1,
        forward_timeout: float = 30.0,
        timeout_after_k_min: float | None = None,
        backward_k_min: int = 1,
        backward_timeout: float = 30.0,
        allow_zero_outputs: bool = False,
        source: ExpertSource | None = None,
        cache_ttl: float = 2.0,
        beam_size: int | None = None,
        exclude_failed_for: float = 5.0,
        checks: AnswerChecks | None = None,
    ) -> None:
        super().__init__(
            peer, in_features=in_features, grid_size=grid_size, uid_prefix=uid_prefix, k_best=k_best, k_min=k_min,
            forward_timeout=forward_timeout, timeout_after_k_min=timeout_after_k_min, backward_k_min=backward_k_min,
            backward_timeout=backward_timeout, allow_zero_outputs=allow_zero_outputs, source=source,
            cache_ttl=cache_ttl, beam_size=beam_size, exclude_failed_for=exclude_failed_for, checks=checks,
        )

    def gate_weights(
        self, grid_scores: list[torch.Tensor], choice: ExpertChoice, answered: torch.Tensor
    ) -> torch.Tensor:
        """``(batch, k)`` router probabilities of the chosen experts (0 where they did not answer)."""
        log_probs = sum(s.log_softmax(dim=1).gather(1, choice.coords(d)) for d, s in enumerate(grid_scores))
        return log_probs.exp() * answered  # type: ignore[union-attr]

    def balancing_loss(self, grid_scores: list[torch.Tensor], choice: ExpertChoice) -> torch.Tensor:
        """The auxiliary load-balancing loss of a batch (differentiable w.r.t. the router)."""
        routed = choice.valid[:, 0]
        loss = grid_scores[0].new_zeros(())
        if not bool(routed.any()):
            return loss
        for d, (scores, g) in enumerate(zip(grid_scores, self.config.grid_size)):
            coords = choice.coords(d)[:, 0][routed]
            fraction = torch.bincount(coords, minlength=g).to(scores.dtype) / coords.numel()
            mean_prob = scores.softmax(dim=1).mean(dim=0)
            loss = loss + g * (fraction * mean_prob).sum()
        return loss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """Runs the mixture on ``x (..., in_features)``; returns ``(output, balancing_loss)``."""
        if x.dim() < 1 or x.shape[-1] != self.config.in_features:
            raise ValueError(f"expected input (..., {self.config.in_features}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.config.in_features)
        grid_scores, choice, outputs, answered = self.route(flat)
        output = self.combine(self.gate_weights(grid_scores, choice, answered), outputs, x.shape[:-1])
        return output, self.balancing_loss(grid_scores, choice)
