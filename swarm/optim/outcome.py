"""What a collective step did: the records `swarm.Optimizer.step` returns and keeps in its history."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundOutcome:
    """What happened to one collective step.

    Attributes:
        epoch: the epoch the round led out of.
        ok: the round averaged and the step was applied.
        group_size: members of the averaging group (1 when this peer stepped alone).
        contributors: members whose tensors are in the mean.
        samples: this peer's samples in the round.
        seconds: wall time of the round, from its start to its step (it overlaps compute when a
            round may be in flight).
        error: why the round failed (None when ok).
        staleness: epochs between the parameters the round's oldest gradients (or inner steps)
            were computed on and the ones its step applied to: 0 when every round is waited for,
            at most `CollaborationConfig.max_staleness` (1) with rounds in flight.
    """

    epoch: int
    ok: bool
    group_size: int
    contributors: int
    samples: int
    seconds: float
    error: str | None = None
    staleness: int = 0


@dataclass(frozen=True)
class StepOutcome:
    """What one call to `Optimizer.step` did.

    Attributes:
        epoch: this peer's epoch after the call.
        round: the collective step attempted in this call, if any.
        state_loaded: this peer was behind (or held a state its epoch's majority does not) and
            downloaded the swarm's state.
        discarded_samples: local samples dropped because the swarm had moved on.
        launched: the epoch of the round this call started averaging in the background (None
            when it started none); its step applies in a later call.
        caught_up: this peer had missed one round and took its step from that round's result
            (the mean its members applied), not from a downloaded state.
    """

    epoch: int
    round: RoundOutcome | None = None
    state_loaded: bool = False
    discarded_samples: int = 0
    launched: int | None = None
    caught_up: bool = False

    @property
    def stepped(self) -> bool:
        """True when this call took (or loaded, or caught up with) a collective step."""
        return self.state_loaded or self.caught_up or (self.round is not None and self.round.ok)
