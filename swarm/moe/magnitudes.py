"""Running references of tensor magnitudes, robust to a minority of liars: what an answer may weigh.

A mixture cannot tell what an expert's output or gradient *should* weigh from the expert alone, but
it can compare the answers of the experts it calls with each other. `NormReference` keeps the typical
row norm (the median over a tensor's rows) of each accepted answer, in a bounded window, and gives
their lower median as the reference: as long as fewer than half of the values in the window come
from liars, the reference lies between honest values, however large or small the lies are. Values
are only added once accepted (or clipped), so a rejected liar never enters the window.

Used by the client's checks of expert answers (`swarm.moe.client.answer_checks`) and by the server's
bound on the gradients its callers send (`swarm.moe.server.gradient_bounds`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["NormReference", "row_norms", "typical_norm"]


def row_norms(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row (first dimension) of `t`, in float32, in one pass over it.

    A row holding NaN or Inf has a NaN or Inf norm (so one pass also checks finiteness), and so has
    a float32 row whose norm overflows (over ~1.8e19). Float CPU tensors go through numpy on the
    calling thread: torch's thread pool, on a machine whose cores the servers share, cost the
    mixture more in spinning threads than the sums themselves (as for `swarm.moe.rows`).
    """
    if t.dim() == 0 or t.shape[0] == 0:
        return torch.zeros(0)
    flat = t.detach().reshape(t.shape[0], -1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        a = flat.numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            return torch.from_numpy(np.sqrt(np.einsum("ij,ij->i", a, a)).astype(np.float32, copy=False))
    return torch.linalg.vector_norm(flat.float(), dim=1).cpu()


def typical_norm(norms: torch.Tensor) -> float:
    """The lower median of a tensor's row norms (0 for no rows)."""
    if norms.numel() == 0:
        return 0.0
    return float(norms.sort().values[(norms.numel() - 1) // 2])


class NormReference:
    """The lower median of the typical norms of the last `window` accepted answers.

    Args:
        window: how many accepted values are kept (older ones drop out, so the reference follows
            honest magnitudes as training changes them).
        settled: below this many values, `reference` also counts the values it is given fresh
            (those of the batch being judged), so that the first batch is judged among its peers.
    """

    def __init__(self, window: int = 128, settled: int = 8) -> None:
        if window < 1 or settled < 1:
            raise ValueError("window and settled must be positive")
        self._values: deque[float] = deque(maxlen=window)
        self.settled = settled

    def __len__(self) -> int:
        return len(self._values)

    def reference(self, fresh: Iterable[float] = ()) -> float | None:
        """The reference magnitude, or None while nothing (finite) is known."""
        values = list(self._values)
        if len(values) < self.settled:
            values.extend(v for v in fresh if math.isfinite(v))
        if not values:
            return None
        values.sort()
        return values[(len(values) - 1) // 2]

    def add(self, value: float) -> None:
        """Records the typical norm of an accepted answer (non-finite values are ignored)."""
        if math.isfinite(value):
            self._values.append(value)
