"""A tiny regression task, its data shards, and a single-process reference run to compare swarms with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

IN, OUT = 8, 2
DATA_SIZE = 4096


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of one fixed function; `seed` picks which samples (0: training, 1: held out)."""
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(DATA_SIZE, IN, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(DATA_SIZE, OUT, generator=g)
    return x, y


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def loss_on(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def adam(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def reference_params(epoch_samples: Sequence[Sequence[int]], data: tuple[torch.Tensor, torch.Tensor],
                     scheduler_gamma: float | None = None) -> list[torch.Tensor]:
    """One process, one step per epoch, on the mean gradient of exactly that epoch's samples."""
    x, y = data
    model = make_model()
    opt = adam(list(model.parameters()))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, scheduler_gamma) if scheduler_gamma else None
    for indices in epoch_samples:
        idx = torch.tensor(sorted(indices))
        opt.zero_grad()
        loss_on(model, x[idx], y[idx]).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def replay_delayed(windows: Sequence[Sequence[tuple[int, Sequence[int]]]],
                   data: tuple[torch.Tensor, torch.Tensor]) -> list[list[torch.Tensor]]:
    """One process replaying delayed steps: the step out of epoch e applies the mean gradient of
    window e's batches, each taken at the parameters of the epoch it was computed at (`version`).

    Returns the parameters at every epoch (index 0: the initial ones).
    """
    x, y = data
    model = make_model()
    params = list(model.parameters())
    opt = adam(params)
    history = [[p.detach().clone() for p in params]]
    for batches in windows:
        current = [p.detach().clone() for p in params]
        total = sum(len(idx) for _, idx in batches)
        sums = [torch.zeros_like(p) for p in params]
        for version, indices in batches:
            with torch.no_grad():
                for p, value in zip(params, history[version]):
                    p.copy_(value)
            model.zero_grad()
            idx = torch.tensor(list(indices))
            loss_on(model, x[idx], y[idx]).backward()
            for s, p in zip(sums, params):
                s.add_(p.grad, alpha=float(len(indices)))
        with torch.no_grad():
            for p, value, s in zip(params, current, sums):
                p.copy_(value)
                p.grad = s / total
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history
