"""Byzantine demo trainers: what an attacking trainer does to its gradients before they are averaged.

`python -m swarm.demo --byzantine N --attack KIND` makes N trainers attack (the first N). Each
attack replaces the trainer's gradients after its local clipping, so what the swarm averages
from it is, for every dense parameter with gradient g:

- ``x1000``: ``1000 g``;
- ``sign_flip``: ``-1000 g`` (ascent, at the scale that moves a plain mean);
- ``random``: Gaussian noise with 1000 times g's RMS;
- ``constant``: one fixed direction (the same on every attacker), with 1000 times g's RMS.

With `--aggregation centered_clip` the swarm's averaging clips them (`swarm.averaging.robust`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ATTACKS = ("x1000", "sign_flip", "random", "constant")
STRENGTH = 1000.0


def attack_gradients(params: Iterable[torch.nn.Parameter], kind: str, generator: torch.Generator) -> None:
    """Replaces each parameter's gradient in place by the attack `kind` (one of `ATTACKS`)."""
    if kind not in ATTACKS:
        raise ValueError(f"unknown attack {kind!r}; one of {ATTACKS}")
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            rms = float(g.pow(2).mean().sqrt()) if g.numel() else 0.0
            if kind == "x1000":
                g.mul_(STRENGTH)
            elif kind == "sign_flip":
                g.mul_(-STRENGTH)
            elif kind == "random":
                g.copy_(torch.randn(g.shape, generator=generator) * (STRENGTH * rms))
            else:
                g.fill_(STRENGTH * rms)
