"""A SwarmTrainer peer as a process, for the restart test: trains the tiny GPT-2 of the examples.

    python trainer_peer.py --initial-peers MADDR --identity PATH --out DIR --steps N [--resume CHECKPOINT | --stand-by]

With `--stand-by` it imports everything, prints `ready`, and waits for a line on stdin: the checkpoint
to resume from (so a restart costs no start-up time in the test). Then it prints `position P` once training begins (its sampler's position, after a resume the checkpoint's),
`step S` after each of its optimizer steps (S: the swarm's step count), `saved S` after each
checkpoint, and saves the swarm's shared parameters to DIR/final.pt before exiting 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).parent))

from fast import RESTART
from gpt2_common import byte_corpus, tiny_gpt2
from transformers import TrainerCallback, TrainingArguments

from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--identity", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--stand-by", action="store_true")
    args = parser.parse_args()
    if args.stand_by:
        print("ready", flush=True)
        args.resume = sys.stdin.readline().strip() or None
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    train, _ = byte_corpus(32, limit=150_000)
    holder: dict[str, SwarmTrainer] = {}

    class Report(TrainerCallback):
        def on_train_begin(self, a, state, control, **kwargs):
            sampler = holder["trainer"]._sampler
            print(f"position {sampler.position if sampler is not None else -1}", flush=True)

        def on_step_end(self, a, state, control, **kwargs):
            print(f"step {state.global_step}", flush=True)

        def on_save(self, a, state, control, **kwargs):
            print(f"saved {state.global_step}", flush=True)

        def on_train_end(self, a, state, control, **kwargs):
            session = holder["trainer"].session
            assert session is not None
            session.optimizer.flush()
            torch.save([t.detach().clone() for t in session.optimizer.shared_tensors], Path(args.out) / "final.pt")

    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=args.steps,
        learning_rate=3e-3, save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000)
    swarm = SwarmArguments(run_id="restart", target_batch_size=24, collaboration=RESTART, initial_peers=tuple(
        args.initial_peers), listen="/ip4/127.0.0.1/tcp/0", identity_path=args.identity)
    trainer = SwarmTrainer(model=tiny_gpt2(context=32), args=training, train_dataset=train, swarm=swarm,
                           callbacks=[Report()])
    holder["trainer"] = trainer
    trainer.train(resume_from_checkpoint=args.resume)


if __name__ == "__main__":
    main()
