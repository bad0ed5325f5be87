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

import torch

from swarm.moe.client.beam_search import ExpertChoice
from swarm.moe.client.mixture import RemoteMixtureOfExperts

__all__ = ["RemoteSwitchMixtureOfExperts"]


class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """A mixture that routes each sample to its best live expert; returns ``(output, balancing_loss)``.

    Takes what `RemoteMixtureOfExperts` takes (a `MixtureConfig`, or its fields as keywords), with
    ``k_best=1`` by default. With a larger `k_best`, every chosen expert that answered contributes,
    each scaled by its own router probability.
    """

    default_k_best = 1

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
