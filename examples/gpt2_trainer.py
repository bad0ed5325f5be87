"""Three local peers train one GPT-2-architecture model with transformers' Trainer, in a swarm.

    python examples/gpt2_trainer.py [--steps 60] [--diloco]

Each peer is an ordinary `Trainer` script with two changes: `SwarmTrainer` in place of `Trainer`, and
`swarm=SwarmArguments(...)`. The three run as threads of this process, on loopback; on three
machines, run the same script on each with `SWARM_INITIAL_PEERS` set to an address the first prints.
The model is random-initialized from a `GPT2Config`, the corpus built with `datasets` from the text
that ships with Python (`gpt2_common.py`): nothing is downloaded. It prints the held-out loss as the
swarm's step count grows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpt2_common import byte_corpus, held_out_loss, tiny_gpt2
from transformers import TrainerCallback, TrainingArguments

from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer
from swarm.optim import DiLoCoConfig
from swarm.peer import Peer


class PrintHeldOutLoss(TrainerCallback):
    def __init__(self, model: torch.nn.Module, held_out, every: int) -> None:
        self.model, self.held_out, self.every, self.last = model, held_out, every, 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 and state.global_step != self.last:
            self.last = state.global_step
            print(f"swarm step {state.global_step:4d}  held-out loss {held_out_loss(self.model, self.held_out):.3f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="the swarm's steps (max_steps)")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--diloco", action="store_true", help="DiLoCo mode (8 local steps per round)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    train, held_out = byte_corpus(64)
    peers: list[Peer] = []
    for _ in range(args.peers):
        peers.append(Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=peers[0].addrs if peers else ()))
    swarm = SwarmArguments(run_id="gpt2-trainer", target_batch_size=None if args.diloco else 32 * args.peers,
                           diloco=DiLoCoConfig(local_steps=8) if args.diloco else None, min_peers=args.peers)
    out = tempfile.mkdtemp(prefix="gpt2-trainer-")
    trainers = []
    for i, peer in enumerate(peers):
        model = tiny_gpt2(context=64)
        training = TrainingArguments(output_dir=f"{out}/peer{i}", per_device_train_batch_size=16,
                                     gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=2e-3,
                                     lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=1.0,
                                     save_steps=10_000, report_to=[], use_cpu=True, disable_tqdm=True,
                                     logging_steps=10_000)
        trainer = SwarmTrainer(model=model, args=training, train_dataset=train, swarm=swarm, peer=peer)
        if i == 0:
            print(f"swarm step    0  held-out loss {held_out_loss(model, held_out):.3f}", flush=True)
            trainer.add_callback(PrintHeldOutLoss(model, held_out, max(1, args.steps // 6)))
        trainers.append(trainer)
    threads = [threading.Thread(target=t.train) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for peer in peers:
        peer.shutdown()


if __name__ == "__main__":
    main()
