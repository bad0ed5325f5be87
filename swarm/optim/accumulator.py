"""Local gradient accumulation between collective steps.

A trainer's loss is a mean over its batch, so one backward pass leaves the mean gradient of `b`
samples in `param.grad`. Accumulating `b * grad` and the sample count `n` gives, after any number
of batches, the local mean `sum / n`; averaging those means across peers with weights `n` gives
exactly the mean gradient of every sample the swarm processed, as if one process had seen the
whole target batch.

With rounds overlapped with compute, the sums of a window that is being averaged move aside
(`begin_round`) and a fresh window accumulates meanwhile; a failed round's sums fold back into
the next window (`abort_round`), so no sample is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GradientAccumulator:
    """Sums of `batch_size * grad` per parameter, the sample count, and a buffer for their mean.

    Args:
        params: the parameters whose gradients are accumulated (their `.grad` may be None:
            a parameter that took no part in a batch contributes zeros).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.sums = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params]
        self.means = [torch.zeros_like(s) for s in self.sums]
        self.samples = 0
        self.steps = 0
        self._spare: list[torch.Tensor] | None = None  # zeroed sums for the next window (allocated on first use)
        self.in_flight: list[torch.Tensor] | None = None  # the sums of the window being averaged
        self.in_flight_samples = 0

    def add(self, batch_size: int) -> None:
        """Adds the current `.grad` of every parameter, weighted by `batch_size`."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        with torch.no_grad():
            for p, acc in zip(self.params, self.sums):
                if p.grad is not None:
                    acc.add_(p.grad, alpha=float(batch_size))
        self.samples += batch_size
        self.steps += 1

    def compute_means(self) -> list[torch.Tensor]:
        """Writes the local mean gradient into `means` (the buffers the averager works on)."""
        scale = 1.0 / max(self.samples, 1)
        with torch.no_grad():
            for acc, mean in zip(self.sums, self.means):
                torch.mul(acc, scale, out=mean)
        return self.means

    def apply_means_to_grads(self) -> None:
        """Copies `means` into each parameter's `.grad` (allocating it where it is None)."""
        with torch.no_grad():
            for p, mean in zip(self.params, self.means):
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)

    def begin_round(self) -> float:
        """Writes the local mean into `means`, moves the window's sums aside and opens a new window.

        Returns the closed window's sample count (this peer's weight in the round).
        """
        if self.in_flight is not None:
            raise RuntimeError("a round is already in flight")
        self.compute_means()
        if self._spare is None:
            self._spare = [torch.zeros_like(s) for s in self.sums]
        self.in_flight, self.sums, self._spare = self.sums, self._spare, None
        self.in_flight_samples, self.samples, self.steps = self.samples, 0, 0
        return float(self.in_flight_samples)

    def in_flight_mean_to_grads(self) -> None:
        """Puts the in-flight window's own mean into `.grad` (no other peer's gradients)."""
        assert self.in_flight is not None
        scale = 1.0 / max(self.in_flight_samples, 1)
        with torch.no_grad():
            for p, acc in zip(self.params, self.in_flight):
                p.grad = acc * scale

    def end_round(self) -> None:
        """The in-flight window was applied: its buffer becomes the next spare."""
        assert self.in_flight is not None
        for acc in self.in_flight:
            acc.zero_()
        self._spare, self.in_flight, self.in_flight_samples = self.in_flight, None, 0

    def abort_round(self) -> None:
        """The round failed: the in-flight window's samples join the current window."""
        assert self.in_flight is not None
        with torch.no_grad():
            for acc, old in zip(self.sums, self.in_flight):
                acc.add_(old)
        self.samples += self.in_flight_samples
        self.end_round()

    def reset(self) -> int:
        """Forgets what was accumulated; returns how many samples that was."""
        discarded = self.samples + self.in_flight_samples
        for acc in self.sums:
            acc.zero_()
        if self.in_flight is not None:
            self.end_round()
        self.samples = 0
        self.steps = 0
        return discarded
