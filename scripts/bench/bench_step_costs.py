#!/usr/bin/env python
"""Benchmark: what a large-batch trainer's own step costs, round by round, without any network.

Runs `swarm.optim.large_batch.LargeBatchMode` on the demo's byte LM (`--hidden-dim 480`: 9.51M
parameters, the model of `bench_overlap.py --hidden-dim 480`) with Adam, one torch thread, and
times each local part of a collective step in CPU time (mean of `--repeat` after one warm-up):
taking a batch in, preparing a round, the trial step an overlapped round takes (and undoing it),
applying a round, catching up from a round's result, and the copy a member keeps of a mean.

    .venv/bin/python scripts/bench/bench_step_costs.py [--hidden-dim 480] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def timed(name: str, repeat: int, body: Callable[[], None]) -> None:
    body()  # warm-up: first-touch pages, lazily created optimizer state
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(repeat):
        body()
    print(f"{name:<58} {(time.thread_time() - cpu) / repeat * 1e3:7.1f} ms CPU "
          f"{(time.perf_counter() - wall) / repeat * 1e3:7.1f} ms wall", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-dim", type=int, default=480)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch

    from swarm.demo.model import ByteLM, LocalExperts, ModelConfig
    from swarm.optim.large_batch import LargeBatchMode

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ModelConfig(hidden_dim=args.hidden_dim)
    params = list(ByteLM(config, LocalExperts(config)).parameters())
    print(f"{sum(p.numel() for p in params):,} parameters, Adam, 1 thread", flush=True)
    mode = LargeBatchMode(params, torch.optim.Adam(params, lr=1e-3), None, trial_step=True)
    for p in params:
        p.grad = torch.randn_like(p)
    mode.on_batch(16)
    mode.prepare_round(0)
    mode.apply_round(0)  # Adam's state exists from here on, as in training

    def batch() -> None:
        mode.on_batch(16)

    def prepare_and_abort() -> None:
        mode.prepare_round(0)
        mode.abort_round(0)

    def trial_and_abort() -> None:
        mode.prepare_round(0)
        mode.overlap(0)
        mode.abort_round(0)

    def waiting_round() -> None:
        mode.prepare_round(0)
        mode.apply_round(0)
        mode.on_batch(16)

    def overlapped_round() -> None:
        mode.prepare_round(0)
        mode.overlap(0)
        mode.apply_round(0)
        mode.on_batch(16)

    result = [m.clone() for m in mode.round_result()]

    def catch_up() -> None:
        mode.apply_result(result)

    def keep_mean() -> None:
        [m.clone() for m in mode.round_result()]

    timed("take a batch in (accumulate)", args.repeat, batch)
    timed("prepare a round (the local mean), abort it", args.repeat, prepare_and_abort)
    timed("prepare, trial step, abort (undo the trial)", args.repeat, trial_and_abort)
    timed("a waited-for round: prepare, apply (+ a batch)", args.repeat, waiting_round)
    timed("an overlapped round: prepare, trial, apply (+ a batch)", args.repeat, overlapped_round)
    timed("catch up from a round's result (apply_result)", args.repeat, catch_up)
    timed("a member's copy of the mean it applied", args.repeat, keep_mean)


if __name__ == "__main__":
    main()
