"""Large-batch mode: peers accumulate gradients until the swarm holds the target batch, then average
them (weighted by samples) and all take the same optimizer step.

After a successful round every member holds the exact weighted mean of the group's gradients
(docs/architecture.md, "Life of an averaging step"), so identical parameters and optimizer states stay identical: the swarm trains as
one process would with the whole target batch (the arithmetic is in `swarm.optim.accumulator`).

With a round in flight (`CollaborationConfig.max_staleness` 1), the window being averaged moves
aside and the trainer accumulates the next one meanwhile: the step of epoch e then applies the
gradients of batches computed at epoch e-1 or e, one step late, as delayed parameter updates do.
Every peer applies the same averaged gradient to the same parameters, so they stay identical at
every epoch.

A gradient one step late costs more than it seems: at the learning rates that train fastest,
Adam's step is large, and the next batches' gradients, computed a whole step behind the
parameters they are applied to, make the loss fall much more slowly (benchmarks/history/BENCHMARKS-2026-12-05.md,
"Communication overlapped with compute": 1.40x the loss of the same steps taken at once, replayed
in one process). So while its round is in flight a peer computes at a guess of where the round
will land (`CollaborationConfig.trial_step`): the optimizer's step on its own part of the round,
taken with the optimizer's state saved and put back, so only the parameters move. The guess is
mostly the optimizer's momentum, which every peer shares. When the average lands, the parameters
are copied back from the ones saved before the trial, bit for bit, and the real step is taken, so
the trial never reaches the shared state; a state served to a newcomer meanwhile is the saved one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from swarm.optim.accumulator import GradientAccumulator
from swarm.optim.progress import SwarmProgress
from swarm.optim.training_state import TrainingState


class LargeBatchMode:
    """Accumulates local gradients and applies the swarm's mean gradient with the user's optimizer.

    Args:
        params: the dense parameters being trained.
        optimizer: the torch optimizer over `params`.
        scheduler: an optional learning-rate scheduler, stepped once per collective step.
    """

    name = "large-batch"
    paced_alone = False  # a round is due when the swarm's samples reach the target
    catches_up = True  # a missed round's step is its mean gradient, applied as the members did

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, trial_step: bool = True) -> None:
        self.params: list[torch.Tensor] = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.accumulator = GradientAccumulator(self.params)
        self.trial_step = trial_step
        self._held: list[torch.Tensor] | None = None  # the shared parameters while a trial step moved them

    @property
    def averaged_fragments(self) -> list[list[torch.Tensor]]:
        """The buffers the averager reduces in place (the local mean gradients): one fragment."""
        return [self.accumulator.means]

    def fragment_of(self, epoch: int) -> int:
        return 0

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """The parameters: identical on every peer between collective steps (while a trial step
        moved them, the ones it moved them from)."""
        return self._held if self._held is not None else self.params

    @property
    def samples(self) -> int:
        """Samples accumulated towards the next collective step."""
        return self.accumulator.samples

    def on_batch(self, batch_size: int) -> None:
        """Takes in the gradients of one local batch (already in `param.grad`)."""
        self.accumulator.add(batch_size)

    def wants_round(self, progress: SwarmProgress) -> bool:
        return self.accumulator.samples > 0 and progress.ready

    def eta(self, progress: SwarmProgress, samples_per_second: float) -> float:
        """When the swarm's reports reach the target batch."""
        return progress.eta

    def prepare_round(self, epoch: int) -> float:
        """Writes the local mean gradient into the averaged buffers and opens the next window;
        returns this peer's weight."""
        return self.accumulator.begin_round()

    def overlap(self, epoch: int) -> None:
        """The round averages while the trainer computes on: with `trial_step`, moves the
        parameters by a trial step on this peer's own mean gradient, to compute at meanwhile."""
        if self.trial_step and self._held is None:
            self._take_trial_step()

    def apply_round(self, epoch: int) -> None:
        """Steps the optimizer (and scheduler) with the averaged gradient."""
        self._undo_trial_step()
        self.accumulator.apply_means_to_grads()
        self._step()

    def round_result(self) -> list[torch.Tensor]:
        """The mean gradient the last round applied: the averaged buffers, until the next round is
        prepared."""
        return self.accumulator.means

    def apply_result(self, result: list[torch.Tensor]) -> None:
        """Steps the optimizer (and scheduler) with a missed round's mean gradient, as its members
        did from the same values; the window being accumulated stays as it is."""
        self._undo_trial_step()
        with torch.no_grad():
            for p, mean in zip(self.params, result):
                if p.grad is None:
                    p.grad = mean.to(p.device, copy=True)
                else:
                    p.grad.copy_(mean)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)

    def _take_trial_step(self) -> None:
        """The optimizer's step on the in-flight window's own mean; `_held` keeps what the
        parameters were."""
        grads = [p.grad for p in self.params]
        self.accumulator.in_flight_mean_to_grads()
        try:
            self._held = take_trial_step(self.optimizer, self.params)
        finally:
            for p, g in zip(self.params, grads):
                p.grad = g

    def _undo_trial_step(self) -> None:
        """Copies the parameters back from before the trial step (bit for bit), if one was taken."""
        if self._held is None:
            return
        with torch.no_grad():
            for p, value in zip(self.params, self._held):
                p.copy_(value)
        self._held = None

    def step_alone(self, epoch: int) -> None:
        """Applies the round's local mean gradient as the whole swarm's (this peer is the only one left).

        It does not go through the averaged buffers: a round cancelled because everyone else left
        may still be writing them.
        """
        self._undo_trial_step()
        self.accumulator.in_flight_mean_to_grads()
        self._step()

    def abort_round(self, epoch: int) -> None:
        """The round failed: its samples join the window being accumulated (retried with it), and
        the parameters go back to the shared ones."""
        self._undo_trial_step()
        self.accumulator.abort_round()

    def _step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.accumulator.end_round()

    def discard(self) -> int:
        """Drops the accumulated gradients (they belong to an epoch the swarm has left)."""
        self._undo_trial_step()
        return self.accumulator.reset()

    def state(self, epoch: int) -> TrainingState:
        return TrainingState(
            epoch, [p.detach() for p in self.shared_tensors], self.optimizer.state_dict(),
            self.scheduler.state_dict() if self.scheduler is not None else None,
        )

    def load_state(self, state: TrainingState) -> None:
        state.check_compatible(self.params)
        self._held = None
        with torch.no_grad():
            for p, value in zip(self.params, state.params):
                p.copy_(value)
        self.optimizer.load_state_dict(state.optimizer)
        if self.scheduler is not None and state.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        self.accumulator.reset()


def take_trial_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Moves `params` by `optimizer.step()` on the gradients in their `.grad`, and puts the
    optimizer's state (and parameter groups) back as they were: only the parameters move.
    Returns copies of the parameters from before the step."""
    held = [p.detach().clone() for p in params]
    saved = copy.deepcopy(optimizer.state_dict())
    try:
        optimizer.step()
    finally:
        optimizer.load_state_dict(saved)
    return held
