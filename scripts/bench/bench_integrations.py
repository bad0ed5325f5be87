"""Overhead of the integrations: samples/s of transformers' Trainer and of Lightning in a swarm, against
the same model, data and settings through a plain `swarm.Optimizer` loop, in one invocation.

    python scripts/bench/bench_integrations.py [--steps 40] [--width 128] [--layers 2] [--repeats 5]

Each path trains a GPT-2-architecture model (random init, byte vocabulary, `examples/gpt2_common.py`)
as a lone peer of its own run (large-batch mode, the target reached by each accumulated batch, so a
collective step per local step: the integration's own per-step cost is what differs). Prints one line
per path and repeat, then the ratio of each integration to the plain loop (goal >= 0.97) in wall-clock
samples/s and in samples per CPU-second of the process (every thread: the peer's loop too), which a
machine shared with other jobs disturbs much less than the wall clock: the median over the repeats of
the ratio within each repeat (the paths interleaved), and its spread (lowest to highest).

Two baselines without a swarm separate what the integration costs from what the framework costs: a
plain torch loop (`torch.optim.AdamW`), and Lightning's own loop with that optimizer and its default
single-device strategy; "Lightning / torch loop" is Lightning's own per-step cost.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import lightning.pytorch as pl
from gpt2_common import byte_corpus, tiny_gpt2
from torch.utils.data import DataLoader
from transformers import TrainingArguments

from swarm.integrations.data import PeerShardSampler
from swarm.integrations.lightning import SwarmStrategy
from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer
from swarm.optim import CollaborationConfig, Optimizer
from swarm.peer import Peer

BATCH = 16
CONFIG = CollaborationConfig(load_state_on_start=False)


Rate = tuple[float, float]  # (samples per wall second, samples per CPU second)


def loop(model, step, args, train) -> Rate:
    """A hand-written training loop: `step()` after each batch's backward."""
    loader = iter(DataLoader(train, batch_size=BATCH, sampler=PeerShardSampler(len(train), 1)))
    for i in range(args.steps + args.warmup):
        if i == args.warmup:
            started, cpu = time.perf_counter(), time.process_time()
        batch = next(loader)
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        step()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    return args.steps * BATCH / seconds, args.steps * BATCH / cpu_seconds


def torch_loop(args, train) -> Rate:
    model = tiny_gpt2(args.layers, args.width, context=args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return loop(model, lambda: (opt.step(), opt.zero_grad()), args, train)


def plain(args, train) -> Rate:
    model = tiny_gpt2(args.layers, args.width, context=args.context)
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        opt = Optimizer(peer, "bench-plain", model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-3),
                        target_batch_size=BATCH, config=CONFIG)
        rate = loop(model, lambda: (opt.step(BATCH), opt.zero_grad()), args, train)
        opt.shutdown()
    return rate


class Timer:
    def __init__(self, warmup: int) -> None:
        self.warmup, self.count = warmup, 0
        self.started = self.ended = self.cpu_started = self.cpu_ended = 0.0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.warmup:
            self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.ended, self.cpu_ended = time.perf_counter(), time.process_time()

    def rate(self) -> Rate:
        samples = (self.count - self.warmup) * BATCH
        return samples / (self.ended - self.started), samples / (self.cpu_ended - self.cpu_started)


def trainer(args, train, out: str) -> Rate:
    from transformers import TrainerCallback

    timer = Timer(args.warmup)

    class Tick(TrainerCallback):
        def on_step_end(self, *a, **k):
            timer.tick()

    model = tiny_gpt2(args.layers, args.width, context=args.context)
    training = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=args.steps + args.warmup,
                                 learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no",
                                 report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10_000)
    t = SwarmTrainer(model=model, args=training, train_dataset=train, callbacks=[Tick()],
                     swarm=SwarmArguments(run_id="bench-hf", target_batch_size=BATCH, collaboration=CONFIG,
                                          listen="/ip4/127.0.0.1/tcp/0"))
    t.train()
    return timer.rate()


def lightning(args, train, swarm: bool = True) -> Rate:
    timer = Timer(args.warmup)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2(args.layers, args.width, context=args.context)

        def training_step(self, batch, idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def on_train_batch_end(self, *a):
            timer.tick()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    if swarm:
        strategy = SwarmStrategy(SwarmArguments(run_id="bench-pl", target_batch_size=BATCH, collaboration=CONFIG,
                                                listen="/ip4/127.0.0.1/tcp/0"), device="cpu")
        sampler, placement = strategy.sampler(len(train)), {"strategy": strategy}
    else:
        sampler, placement = PeerShardSampler(len(train), 1), {"accelerator": "cpu", "devices": 1}
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
    pl.Trainer(**placement, max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Module(), loader)
    return timer.rate()


RATIOS = (("trainer", "plain", "SwarmTrainer / plain swarm.Optimizer loop"),
          ("lightning", "plain", "SwarmStrategy / plain swarm.Optimizer loop"),
          ("lightning-native", "torch", "Lightning without a swarm / torch loop without a swarm (Lightning's own cost)"),
          ("plain", "torch", "plain swarm.Optimizer loop / torch loop (the swarm's own cost, lone peer)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    for name in ("lightning", "transformers", "swarm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    train, _ = byte_corpus(args.context)
    paths: dict[str, Callable[[], Rate]] = {
        "torch": lambda: torch_loop(args, train), "plain": lambda: plain(args, train),
        "trainer": lambda: trainer(args, train, tempfile.mkdtemp()), "lightning": lambda: lightning(args, train),
        "lightning-native": lambda: lightning(args, train, swarm=False)}
    results: dict[str, list[Rate]] = {name: [] for name in paths}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for r in range(args.repeats):  # interleaved, so drift of the machine's load hits every path alike
        for name, run in paths.items():
            wall, cpu = run()
            results[name].append((wall, cpu))
            print(f"{name:16s} repeat {r}: {wall:8.1f} samples/s, {cpu:8.1f} samples per CPU-second", flush=True)
    for index, unit in ((1, "samples per CPU-second"), (0, "samples/s")):
        for path, base, label in RATIOS:
            ratios = sorted(a[index] / b[index] for a, b in zip(results[path], results[base]))
            print(f"{label}: {statistics.median(ratios):.3f}x in {unit} (median of {args.repeats} repeats, spread "
                  f"{ratios[0]:.3f}-{ratios[-1]:.3f}; medians {statistics.median(r[index] for r in results[path]):.1f} vs "
                  f"{statistics.median(r[index] for r in results[base]):.1f}; goal >= 0.97x for the integrations)",
                  flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
