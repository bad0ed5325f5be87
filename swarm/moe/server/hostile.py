"""Hostile answers: a fault an expert server can be told to commit, for tests and demos only.

An honest server never uses this. `ExpertServerConfig.hostile` (and `swarm-peer --expert-hostile`,
which the demo's `--hostile-experts` passes to a second expert server) makes every expert of the
server lie in its answers, forward and backward, so that the defences of the mixtures that call it
(`swarm.moe.client.answer_checks`) meet real lies over the real wire:

- ``x1e6``: every answer (outputs, input gradients) multiplied by 1e6;
- ``nan``: every answer NaN;
- ``shape``: every answer one column wider than the expert's schema says;
- ``sometimes``: every third batch of each expert (and direction) multiplied by 1e6, the others honest;
- ``flip``: every answer negated: finite, of the right shape and of honest magnitude, so that only a
  comparison with another server of the same expert (`swarm.moe.client.spot_checks`) can see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a lie is told, so the CLI checks a mode without it
    import torch

__all__ = ["HOSTILE_MODES", "HostileAnswers"]

HOSTILE_MODES = ("x1e6", "nan", "shape", "sometimes", "flip")
SCALE = 1e6
SOMETIMES_EVERY = 3


class HostileAnswers:
    """Corrupts one expert's answers in one direction (one instance per expert and direction: the
    runtime runs one batch of an expert at a time, so the count needs no lock).

    Args:
        mode: one of `HOSTILE_MODES`.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str) -> None:
        if mode not in HOSTILE_MODES:
            raise ValueError(f"unknown hostile mode {mode!r}; one of {HOSTILE_MODES}")
        self.mode = mode
        self.batches = 0

    def corrupt(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Returns the lies told in place of `tensors` (one batch's answer)."""
        self.batches += 1
        if self.mode == "sometimes" and self.batches % SOMETIMES_EVERY:
            return tensors
        return tuple(self._lie(t) for t in tensors)

    def _lie(self, t: torch.Tensor) -> torch.Tensor:
        import torch

        if not t.is_floating_point():
            return t
        if self.mode == "nan":
            return torch.full_like(t, float("nan"))
        if self.mode == "flip":
            return -t
        if self.mode == "shape":
            return torch.cat([t, t[..., :1]], dim=-1) if t.dim() >= 2 else t
        return t * SCALE
