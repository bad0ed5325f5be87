"""What a one-step-late gradient costs: one process, no swarm, replaying large-batch mode's steps.

With rounds overlapped (`CollaborationConfig.max_staleness` 1) every collective step applies the
swarm's mean gradient of the batches computed before the previous step landed. This replays that
on bench_training's model and data in one process: Adam (betas 0.9, 0.98) with linear warm-up, the
gradient of step t applied at step t (waiting rounds) or at step t+1 (overlapped rounds), and
prints the held-out loss after the same number of steps. Not timed: the figure is the loss.

    .venv/bin/python scripts/bench/bench_staleness.py [--steps 117] [--settings 128:0.0085 172:0.0085]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_training


def replay(batch: int, lr: float, steps: int, delay: int, warmup: int) -> float:
    import torch

    model, train, held_out = bench_training._setup(1)
    adam = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda step: min(1.0, (step + 1) / warmup))
    gen = torch.Generator().manual_seed(1)
    late: list[torch.Tensor] | None = None
    for _ in range(steps + delay):
        x, y = train.batch(batch, gen)
        model.zero_grad()
        model.loss(x, y).backward()
        grads: list[torch.Tensor] | None = [p.grad.detach().clone() for p in model.parameters()]
        if delay:
            grads, late = late, grads
        if grads is None:
            continue
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        adam.step()
        scheduler.step()
    return bench_training._evaluate(model, held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=117)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["128:0.0085", "172:0.0085"],
                        help="BATCH:LR pairs, each replayed with the gradient applied at once and one step late")
    args = parser.parse_args()
    for setting in args.settings:
        batch, lr = setting.split(":")
        now, late = (replay(int(batch), float(lr), args.steps, delay, args.warmup) for delay in (0, 1))
        print(f"batch {batch}, lr {lr}, {args.steps} steps: held-out loss {now:.3f} with each gradient applied "
              f"at once, {late:.3f} one step late ({late / now:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
