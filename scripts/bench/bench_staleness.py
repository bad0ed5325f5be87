"""What a one-step-late gradient costs: one process, no swarm, replaying large-batch mode's steps.

With rounds overlapped (`CollaborationConfig.max_staleness` 1) every collective step applies the
swarm's mean gradient of the batches computed before the previous step landed. This replays that
on bench_training's model and data in one process: Adam (betas 0.9, 0.98) with linear warm-up, the
gradient of step t applied at step t (waiting rounds) or at step t+1 (overlapped rounds), and
prints the held-out loss after the same number of steps. `--speculate N` adds the overlapped
replay with `CollaborationConfig.trial_step`: the batch is N trainers' shares, each share's
gradient computed at the parameters moved by Adam's trial step on that trainer's previous share.
Not timed: the figure is the loss.

    .venv/bin/python scripts/bench/bench_staleness.py [--steps 117] [--settings 128:0.0085 172:0.0085]
        [--speculate 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_training


def replay(batch: int, lr: float, steps: int, delay: int, warmup: int, speculate: int = 0) -> float:
    """`speculate` (with delay 1): the number of trainers sharing each batch; each computes its
    share's gradient at the shared parameters moved by a trial of the step still in flight (Adam's
    step on its own previous share, `trial_step`), not at the shared parameters themselves."""
    import torch

    model, train, held_out = bench_training._setup(1)
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda step: min(1.0, (step + 1) / warmup))
    gen = torch.Generator().manual_seed(1)
    late: list[torch.Tensor] | None = None
    trials: list[list[torch.Tensor] | None] = [None] * max(speculate, 1)
    for _ in range(steps + delay):
        x, y = train.batch(batch, gen)
        grads: list[torch.Tensor] | None
        if speculate:
            share = batch // speculate
            owns = []
            for k in range(speculate):
                _move(params, trials[k], 1.0)
                model.zero_grad()
                model.loss(x[k * share:(k + 1) * share], y[k * share:(k + 1) * share]).backward()
                owns.append([p.grad.detach().clone() for p in params])
                _move(params, trials[k], -1.0)
            grads = [torch.stack(gs).mean(0) for gs in zip(*owns)]
        else:
            model.zero_grad()
            model.loss(x, y).backward()
            grads = [p.grad.detach().clone() for p in params]
        if delay:
            grads, late = late, grads
        if grads is not None:
            for p, g in zip(params, grads):
                p.grad = g
            adam.step()
            scheduler.step()
        if speculate:
            trials = [trial_step(adam, own) for own in owns]
    return bench_training._evaluate(model, held_out)


def trial_step(adam: Any, grads: list[Any]) -> list[Any]:
    """What `adam.step()` would add to each parameter with `grads`, its state left as it is."""
    import torch

    group = adam.param_groups[0]
    beta1, beta2 = group["betas"]
    moves = []
    for p, g in zip(group["params"], grads):
        state = adam.state.get(p)
        if not state:
            moves.append(torch.zeros_like(p))
            continue
        step = float(state["step"]) + 1
        m = state["exp_avg"] * beta1 + g * (1 - beta1)
        v = state["exp_avg_sq"] * beta2 + g * g * (1 - beta2)
        denom = (v / (1 - beta2 ** step)).sqrt() + group["eps"]
        moves.append(-group["lr"] / (1 - beta1 ** step) * m / denom)
    return moves


def _move(params: list[Any], moves: list[Any] | None, sign: float) -> None:
    import torch

    if moves is not None:
        with torch.no_grad():
            for p, d in zip(params, moves):
                p.add_(d, alpha=sign)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=117)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--speculate", type=int, default=0,
                        help="also replay one step late with N trainers' trial steps (bench_staleness.replay)")
    parser.add_argument("--settings", nargs="+", default=["128:0.0085", "172:0.0085"],
                        help="BATCH:LR pairs, each replayed with the gradient applied at once and one step late")
    args = parser.parse_args()
    for setting in args.settings:
        batch, lr = setting.split(":")
        now, late = (replay(int(batch), float(lr), args.steps, delay, args.warmup) for delay in (0, 1))
        line = (f"batch {batch}, lr {lr}, {args.steps} steps: held-out loss {now:.3f} with each gradient applied "
                f"at once, {late:.3f} one step late ({late / now:.3f}x)")
        if args.speculate:
            trial = replay(int(batch), float(lr), args.steps, 1, args.warmup, args.speculate)
            line += f", {trial:.3f} one step late from {args.speculate} trainers' trial steps ({trial / now:.3f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
