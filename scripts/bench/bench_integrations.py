"""Overhead of the integrations: samples/s of transformers' Trainer and of Lightning in a swarm, against
the same model, data and settings through a plain `swarm.Optimizer` loop, in one invocation.

    python scripts/bench/bench_integrations.py [--steps 40] [--width 128] [--layers 2] [--repeats 2]

Each path trains a GPT-2-architecture model (random init, byte vocabulary, `examples/gpt2_common.py`)
as a lone peer of its own run (large-batch mode, the target reached by each accumulated batch, so a
collective step per local step: the integration's own per-step cost is what differs). Prints one line
per path and repeat, then the ratio of each integration's best to the plain loop's best (goal >= 0.97).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
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


def plain(args, train) -> float:
    model = tiny_gpt2(args.layers, args.width, context=args.context)
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        opt = Optimizer(peer, "bench-plain", model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-3),
                        target_batch_size=BATCH, config=CONFIG)
        loader = iter(DataLoader(train, batch_size=BATCH, sampler=PeerShardSampler(len(train), 1)))
        for i in range(args.steps + args.warmup):
            if i == args.warmup:
                started = time.perf_counter()
            batch = next(loader)
            model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
            opt.step(BATCH)
            opt.zero_grad()
        seconds = time.perf_counter() - started
        opt.shutdown()
    return args.steps * BATCH / seconds


class Timer:
    def __init__(self, warmup: int) -> None:
        self.warmup, self.count, self.started, self.ended = warmup, 0, 0.0, 0.0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.warmup:
            self.started = time.perf_counter()
        self.ended = time.perf_counter()


def trainer(args, train, out: str) -> float:
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
    return (timer.count - timer.warmup) * BATCH / (timer.ended - timer.started)


def lightning(args, train) -> float:
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

    strategy = SwarmStrategy(SwarmArguments(run_id="bench-pl", target_batch_size=BATCH, collaboration=CONFIG,
                                            listen="/ip4/127.0.0.1/tcp/0"), device="cpu")
    loader = DataLoader(train, batch_size=BATCH, sampler=strategy.sampler(len(train)))
    pl.Trainer(strategy=strategy, max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Module(), loader)
    return (timer.count - timer.warmup) * BATCH / (timer.ended - timer.started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    for name in ("lightning", "transformers", "swarm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    train, _ = byte_corpus(args.context)
    results: dict[str, list[float]] = {"plain": [], "trainer": [], "lightning": []}
    import tempfile
    for r in range(args.repeats):  # interleaved, so drift of the machine's load hits every path alike
        for name, run in (("plain", lambda: plain(args, train)), ("trainer", lambda: trainer(args, train, tempfile.mkdtemp())),
                          ("lightning", lambda: lightning(args, train))):
            rate = run()
            results[name].append(rate)
            print(f"{name:10s} repeat {r}: {rate:8.1f} samples/s", flush=True)
    best = {k: max(v) for k, v in results.items()}
    for name in ("trainer", "lightning"):
        print(f"{name} / plain swarm.Optimizer loop: {best[name] / best['plain']:.3f}x "
              f"({best[name]:.1f} vs {best['plain']:.1f} samples/s, best of {args.repeats}; goal >= 0.97x)")


if __name__ == "__main__":
    main()
