"""The contract between `swarm.Optimizer` and a training mode (large-batch, DiLoCo).

The optimizer owns the protocol around a collective step (progress, rounds, state transfer,
faults); a mode owns the arithmetic: what a local batch does, when a round is due, which tensors
are averaged, how the averaged tensors become a step, and what state a newcomer downloads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from swarm.optim.progress import SwarmProgress
from swarm.optim.training_state import TrainingState


class TrainingMode(Protocol):
    """A way of turning local batches and averaging rounds into identical steps on every peer."""

    name: str
    optimizer: torch.optim.Optimizer
    paced_alone: bool
    """True when a round is due after this peer's own local work (DiLoCo's H inner steps), not
    when the swarm's reports add up to a target: the others cannot tell when it comes unless it
    says so, so it announces its next round as soon as that is known (`Optimizer._announce_round`)."""

    @property
    def averaged_fragments(self) -> list[list[torch.Tensor]]:
        """The buffers rounds average in place, per fragment (fixed for the mode's lifetime);
        one fragment unless the mode syncs its parameters in turns."""
        ...

    def fragment_of(self, epoch: int) -> int:
        """The fragment the round leading out of `epoch` averages."""
        ...

    @property
    def shared_tensors(self) -> list[torch.Tensor]:
        """The values every peer at an epoch holds alike (fingerprinted to detect diverged groups)."""
        ...

    @property
    def samples(self) -> int:
        """Local samples in the current round."""
        ...

    def on_batch(self, batch_size: int) -> None:
        """Takes in one local batch whose gradients are in `param.grad`."""
        ...

    def wants_round(self, progress: SwarmProgress) -> bool:
        """True when this peer should average now."""
        ...

    def eta(self, progress: SwarmProgress, samples_per_second: float) -> float:
        """Seconds until this peer's next round is due, at `samples_per_second` (inf: unknown)."""
        ...

    def prepare_round(self, epoch: int) -> float:
        """Fills the round's fragment with this peer's contribution and sets that contribution
        aside, so local work can go on while the round is averaged; returns its weight."""
        ...

    def overlap(self, epoch: int) -> None:
        """The round of `epoch`, prepared, averages while local work goes on until it lands."""
        ...

    def apply_round(self, epoch: int) -> None:
        """Turns the averaged tensors into the collective step."""
        ...

    def step_alone(self, epoch: int) -> None:
        """Takes the collective step with this peer's contribution only (no other peer is alive)."""
        ...

    def abort_round(self, epoch: int) -> None:
        """The round failed: its contribution rejoins the local work, to be sent again."""
        ...

    catches_up: bool
    """True when a peer that missed one round can take that round's step from its result
    (`round_result` of a member, `apply_result`) instead of downloading the whole state."""

    def round_result(self) -> list[torch.Tensor]:
        """The tensors the last round's step was taken from (valid from its `apply_round` until the
        next `prepare_round`; only where `catches_up`)."""
        ...

    def apply_result(self, result: list[torch.Tensor]) -> None:
        """Takes the step a missed round took, from a member's `round_result`: the same step, bit for
        bit, as the members took; the local work is left as it is (only where `catches_up`)."""
        ...

    def discard(self) -> int:
        """Drops the current round's local work; returns its samples."""
        ...

    def state(self, epoch: int) -> TrainingState:
        """What every peer agrees on (views of live tensors: clone before sending)."""
        ...

    def load_state(self, state: TrainingState) -> None:
        """Adopts the swarm's state and starts a new round from it."""
        ...
