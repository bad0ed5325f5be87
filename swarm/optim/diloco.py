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

Two extensions, both on by default where the configuration asks for them:

- Overlap (`CollaborationConfig.max_staleness` 1): a round's averaging runs while the peer keeps
  taking inner steps from where it was. When the average arrives, the outer step updates θ as
  above, and the local parameters move by what the outer step changed relative to the point the
  round started from (`x += θ_new - x_at_round_start`), keeping the inner steps taken meanwhile.
  They count towards the next round, so the trainer never waits unless a round outlasts the next
  round's inner steps.
- Fragments (`DiLoCoConfig.fragments` F, Streaming DiLoCo, Douillard et al. 2025): the parameters
  are cut into F contiguous fragments of about equal size; round e syncs fragment e mod F, every
  H/F inner steps, so each fragment is synced every H steps and one round carries 1/F of the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarm.core.errors import ConfigError
from swarm.optim.config import DiLoCoConfig
from swarm.optim.progress import SwarmProgress
from swarm.optim.training_state import TrainingState


class DiLoCoMode:
    """Inner steps with the user's optimizer; outer Nesterov steps on averaged pseudo-gradients.

    Args:
        params: the dense parameters being trained.
        inner_optimizer: the user's optimizer over `params`, stepped on every local batch.
        scheduler: an optional scheduler of the inner optimizer, stepped on every local batch.
        config: H, outer learning rate and momentum, fragments.

    Raises:
        ConfigError: more fragments than parameter tensors.
    """

    name = "diloco"
    paced_alone = True  # a round is due after this peer's own H inner steps
    # a late peer downloads the state: its inner steps since the last outer step would not apply
    # to the outer parameters the missed round moved, and fragments take turns
    catches_up = False

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
        self.fragments = split_fragments([p.numel() for p in self.params], config.fragments)
        self._own = [torch.zeros_like(p) for p in self.outer_params]  # this peer's Δ of the round in flight
        self.local_steps = 0  # inner steps since the last round started
        self._samples = 0
        self._batch = 0  # samples of the last inner step
        self._in_flight: tuple[int, int, int] | None = None  # (fragment, its inner steps, its samples)

    @property
    def averaged_fragments(self) -> list[list[torch.Tensor]]:
        """The pseudo-gradient buffers of each fragment, averaged in place by that fragment's rounds."""
        return [[self.pseudo_gradients[i] for i in fragment] for fragment in self.fragments]

    def fragment_of(self, epoch: int) -> int:
        """The fragment round `epoch` syncs."""
        return epoch % len(self.fragments)

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """The outer parameters θ: identical on every peer at an epoch (local parameters drift apart)."""
        return self.outer_params

    @property
    def samples(self) -> int:
        """Samples processed since the last round started."""
        return self._samples

    def on_batch(self, batch_size: int) -> None:
        """One inner step with the gradients in `param.grad`."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.local_steps += 1
        self._samples += batch_size
        self._batch = batch_size

    def wants_round(self, progress: SwarmProgress) -> bool:
        return self.local_steps >= self.config.steps_per_round

    def eta(self, progress: SwarmProgress, samples_per_second: float) -> float:
        """The inner steps left before the next round, at this peer's own pace."""
        if self._batch == 0 or samples_per_second <= 0:
            return math.inf
        left = max(0, self.config.steps_per_round - self.local_steps)
        return left * self._batch / samples_per_second

    def prepare_round(self, epoch: int) -> float:
        """Computes Δ = θ - x of the round's fragment into its averaged buffers (and keeps a copy);
        the inner steps from now on count towards the next round. Returns this peer's weight."""
        fragment = self.fragment_of(epoch)
        with torch.no_grad():
            for i in self.fragments[fragment]:
                torch.sub(self.outer_params[i], self.params[i], out=self.pseudo_gradients[i])
                self._own[i].copy_(self.pseudo_gradients[i])
        self._in_flight = (fragment, self.local_steps, self._samples)
        weight = float(max(self._samples, 1))
        self.local_steps, self._samples = 0, 0
        return weight

    def overlap(self, epoch: int) -> None:
        """Nothing to do: the inner steps go on from the local parameters while the round averages."""

    def apply_round(self, epoch: int) -> None:
        """Outer Nesterov step of the fragment with the averaged Δ; the local parameters follow."""
        self._outer_step([self.pseudo_gradients[i] for i in self.fragments[self.fragment_of(epoch)]])

    def step_alone(self, epoch: int) -> None:
        """Outer step with this peer's own Δ (not through the averaged buffers: a round cancelled
        because everyone else left may still be writing them)."""
        self._outer_step([self._own[i] for i in self.fragments[self.fragment_of(epoch)]])

    def abort_round(self, epoch: int) -> None:
        """The round failed: the local parameters keep their progress (the next Δ of the fragment
        includes it) and the round is due again at once."""
        assert self._in_flight is not None
        _, steps, samples = self._in_flight
        self._in_flight = None
        self.local_steps = max(self.local_steps + steps, self.config.steps_per_round)
        self._samples += samples

    def _outer_step(self, deltas: Sequence[torch.Tensor]) -> None:
        assert self._in_flight is not None
        fragment = self._in_flight[0]
        indices = self.fragments[fragment]
        with torch.no_grad():
            before = [self.outer_params[i].detach().clone() for i in indices]
        for i, delta in zip(indices, deltas):
            self.outer_params[i].grad = delta
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for i, old in zip(indices, before):
                if self.local_steps == 0:
                    self.params[i].copy_(self.outer_params[i])  # nothing happened meanwhile: restart at θ
                else:
                    # x_at_round_start = θ_old - Δ_own; x += θ_new - x_at_round_start keeps the steps since
                    self.params[i].add_(self.outer_params[i] - old + self._own[i])
        self._in_flight = None

    def round_result(self) -> list[torch.Tensor]:
        raise NotImplementedError("DiLoCo mode does not catch up from a round's result")

    def apply_result(self, result: list[torch.Tensor]) -> None:
        raise NotImplementedError("DiLoCo mode does not catch up from a round's result")

    def discard(self) -> int:
        """Forgets the local steps (the swarm moved on); returns their samples."""
        discarded = self._samples + (self._in_flight[2] if self._in_flight is not None else 0)
        self._restart_from_outer()
        return discarded

    def _restart_from_outer(self) -> None:
        with torch.no_grad():
            for p, start in zip(self.params, self.outer_params):
                p.copy_(start)
        self.local_steps = 0
        self._samples = 0
        self._in_flight = None

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


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Cuts tensors of these sizes, in order, into `count` contiguous groups of about equal total size.

    Returns the tensor indices of each group, every group non-empty.

    Raises:
        ConfigError: fewer tensors than groups.
    """
    if count > len(sizes):
        raise ConfigError(f"cannot cut {len(sizes)} parameter tensors into {count} fragments")
    total = sum(sizes)
    groups: list[list[int]] = [[] for _ in range(count)]
    done = 0
    group = 0
    for i, size in enumerate(sizes):
        left_tensors, left_groups = len(sizes) - i, count - group
        # move on once this group has its share, or when every later group needs one of the tensors left
        if groups[group] and group < count - 1 and (
                done + size / 2 > total * (group + 1) / count or left_tensors <= left_groups - 1):
            group += 1
        groups[group].append(i)
        done += size
    return groups
