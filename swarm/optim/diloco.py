"""DiLoCo mode: H local steps, then one outer step on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1: every worker starts a round from the shared parameters θ, runs H steps of its
inner optimizer (AdamW in the paper) on its own data, and the workers average the
pseudo-gradient Δ = θ - θ_local; the outer optimizer (SGD with Nesterov momentum) then updates θ
with Δ as its gradient, and every worker starts the next round from the new θ. Communication
happens once per H steps, and Δ tolerates lossy compression, so a round sends ~H x 4 times
fewer bytes than per-step float32 gradient averaging.

The outer parameters θ and the outer momentum are identical on every member after a successful
round, so they (with the epoch) are the state a newcomer downloads; inner optimizer state stays
local, as in the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.optim.config import DiLoCoConfig
from swarm.optim.progress import SwarmProgress
from swarm.optim.training_state import TrainingState


class DiLoCoMode:
    """Inner steps with the user's optimizer; outer Nesterov steps on averaged pseudo-gradients.

    Args:
        params: the dense parameters being trained.
        inner_optimizer: the user's optimizer over `params`, stepped on every local batch.
        scheduler: an optional scheduler of the inner optimizer, stepped on every local batch.
        config: H, outer learning rate and momentum.
    """

    name = "diloco"

    def __init__(self, params: Sequence[torch.nn.Parameter], inner_optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, config: DiLoCoConfig) -> None:
        self.params = list(params)
        self.optimizer = inner_optimizer
        self.scheduler = scheduler
        self.config = config
        with torch.no_grad():
            self.outer_params: list[torch.Tensor] = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.outer_params, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov,
        )
        self.pseudo_gradients = [torch.zeros_like(p) for p in self.outer_params]
        self.local_steps = 0
        self._samples = 0

    @property
    def averaged_tensors(self) -> list[torch.Tensor]:
        return self.pseudo_gradients

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """The round-start parameters θ: identical on every peer (local parameters drift apart)."""
        return self.outer_params

    @property
    def samples(self) -> int:
        """Samples processed since the round started."""
        return self._samples

    def on_batch(self, batch_size: int) -> None:
        """One inner step with the gradients in `param.grad`."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.local_steps += 1
        self._samples += batch_size

    def wants_round(self, progress: SwarmProgress) -> bool:
        return self.local_steps >= self.config.local_steps

    def prepare_round(self) -> float:
        """Computes Δ = θ_round_start - θ_local into the averaged buffers; returns this peer's weight."""
        with torch.no_grad():
            for delta, start, p in zip(self.pseudo_gradients, self.outer_params, self.params):
                torch.sub(start, p, out=delta)
        return float(max(self._samples, 1))

    def apply_round(self) -> None:
        """Outer Nesterov step with the averaged Δ; every member restarts from the new θ."""
        self._outer_step(self.pseudo_gradients)

    def step_alone(self) -> None:
        """Outer step with this peer's own Δ (not through the averaged buffers: a round cancelled
        because everyone else left may still be writing them)."""
        with torch.no_grad():
            self._outer_step([start - p for start, p in zip(self.outer_params, self.params)])

    def _outer_step(self, deltas: Sequence[torch.Tensor]) -> None:
        for start, delta in zip(self.outer_params, deltas):
            start.grad = delta
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        self._restart_from_outer()

    def discard(self) -> int:
        """Forgets the local steps of this round (the swarm moved on); returns their samples."""
        discarded = self._samples
        self._restart_from_outer()
        return discarded

    def _restart_from_outer(self) -> None:
        with torch.no_grad():
            for p, start in zip(self.params, self.outer_params):
                p.copy_(start)
        self.local_steps = 0
        self._samples = 0

    def state(self, epoch: int) -> TrainingState:
        return TrainingState(
            epoch, [p.detach() for p in self.outer_params], self.outer_optimizer.state_dict(),
            self.scheduler.state_dict() if self.scheduler is not None else None,
        )

    def load_state(self, state: TrainingState) -> None:
        state.check_compatible(self.params)
        with torch.no_grad():
            for start, value in zip(self.outer_params, state.params):
                start.copy_(value)
        self.outer_optimizer.load_state_dict(state.optimizer)
        if self.scheduler is not None and state.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        self._restart_from_outer()
