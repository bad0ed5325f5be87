"""What a one-step-late gradient costs: one process, no swarm, replaying large-batch mode's steps.

With rounds overlapped (`CollaborationConfig.max_staleness` 1) every collective step applies the
swarm's mean gradient of the batches computed before the previous step landed. This replays that
on bench_training's model and data in one process: Adam (betas 0.9, 0.98) with linear warm-up, the
gradient of step t applied at step t (waiting rounds) or at step t+1 (overlapped rounds), and
prints the held-out loss after the same number of steps. `--speculate N` adds the overlapped
replay with `CollaborationConfig.trial_step`: the batch is N trainers' shares, each share's
gradient computed at the parameters moved by the trial step (`swarm.optim.large_batch.take_trial_step`) on
that trainer's previous share.
Not timed: the figure is the loss.

    .venv/bin/python scripts/bench/bench_staleness.py [--steps 117] [--settings 128:0.0085 172:0.0085]
        [--speculate 4 | --at-once-only] [--hidden-dim 480]

`--at-once-only` replays waiting rounds alone: how far a given number of collective steps gets at
each learning rate (what the swarm's step count is worth, whatever its averaging).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_training


def replay(batch: int, lr: float, steps: int, delay: int, warmup: int, speculate: int = 0,
           hidden_dim: int = 128) -> float:
    """`speculate` (with delay 1): the number of trainers sharing each batch; each computes its
    share's gradient at the shared parameters moved by a trial of the step still in flight
    (`swarm.optim.large_batch.take_trial_step` on its own previous share), not at the shared
    parameters themselves."""
    import torch

    from swarm.optim.large_batch import take_trial_step

    model, train, held_out = bench_training._setup(1, hidden_dim)
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda step: min(1.0, (step + 1) / warmup))
    gen = torch.Generator().manual_seed(1)
    late: list[torch.Tensor] | None = None
    previous: list[list[torch.Tensor]] | None = None  # each trainer's share of the step in flight
    for _ in range(steps + delay):
        x, y = train.batch(batch, gen)
        grads: list[torch.Tensor] | None
        if speculate:
            share = batch // speculate
            owns = []
            for k in range(speculate):
                held = None
                if previous is not None:
                    for p, g in zip(params, previous[k]):
                        p.grad = g
                    held = take_trial_step(adam, params)
                model.zero_grad()
                model.loss(x[k * share:(k + 1) * share], y[k * share:(k + 1) * share]).backward()
                owns.append([p.grad.detach().clone() for p in params])
                if held is not None:
                    with torch.no_grad():
                        for p, value in zip(params, held):
                            p.copy_(value)
            grads = [torch.stack(gs).mean(0) for gs in zip(*owns)]
            previous = owns
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
    return bench_training._evaluate(model, held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=117)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--speculate", type=int, default=0,
                        help="also replay one step late with N trainers' trial steps (bench_staleness.replay)")
    parser.add_argument("--settings", nargs="+", default=["128:0.0085", "172:0.0085"],
                        help="BATCH:LR pairs, each replayed with the gradient applied at once and one step late")
    parser.add_argument("--hidden-dim", type=int, default=128,
                        help="the model's width (480: the 9.5M-parameter model of the overlap comparison, "
                             "bench_overlap.py --hidden-dim 480; default: the demo's)")
    parser.add_argument("--at-once-only", action="store_true",
                        help="replay each setting with the gradient applied at once only (waiting rounds)")
    args = parser.parse_args()
    if args.at_once_only and args.speculate:
        parser.error("--speculate replays late gradients: it does not go with --at-once-only")
    for setting in args.settings:
        batch, lr = setting.split(":")
        if args.at_once_only:
            now = replay(int(batch), float(lr), args.steps, 0, args.warmup, hidden_dim=args.hidden_dim)
            print(f"batch {batch}, lr {lr}, warm-up {args.warmup}, {args.steps} steps: held-out loss {now:.3f} "
                  f"with each gradient applied at once", flush=True)
            continue
        now, late = (replay(int(batch), float(lr), args.steps, delay, args.warmup, hidden_dim=args.hidden_dim)
                     for delay in (0, 1))
        line = (f"batch {batch}, lr {lr}, {args.steps} steps: held-out loss {now:.3f} with each gradient applied "
                f"at once, {late:.3f} one step late ({late / now:.3f}x)")
        if args.speculate:
            trial = replay(int(batch), float(lr), args.steps, 1, args.warmup, args.speculate, args.hidden_dim)
            line += f", {trial:.3f} one step late from {args.speculate} trainers' trial steps ({trial / now:.3f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
