"""Three local peers train one GPT-2-architecture model with PyTorch Lightning's Trainer, in a swarm.

    python examples/gpt2_lightning.py [--steps 60]

The `LightningModule` is an ordinary one; the swarm is `Trainer(strategy=SwarmStrategy(...))` and the
strategy's sampler in the DataLoader. The three peers run as threads of this process, on loopback;
on three machines, run the same script on each with `SWARM_INITIAL_PEERS` set. Same model and corpus
as `gpt2_trainer.py`; it prints the held-out loss as the swarm's step count grows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))

from gpt2_common import byte_corpus, held_out_loss, tiny_gpt2

from swarm.integrations.lightning import SwarmStrategy
from swarm.integrations.session import SwarmArguments
from swarm.peer import Peer


class CausalLM(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.model = tiny_gpt2(context=64)
        self.steps = steps

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class PrintHeldOutLoss(pl.Callback):
    def __init__(self, held_out, every: int) -> None:
        self.held_out, self.every, self.last = held_out, every, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.strategy.global_step
        if step % self.every == 0 and step != self.last:
            self.last = step
            print(f"swarm step {step:4d}  held-out loss {held_out_loss(module.model, self.held_out):.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="the swarm's steps")
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    train, held_out = byte_corpus(64)
    peers: list[Peer] = []
    for _ in range(args.peers):
        peers.append(Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=peers[0].addrs if peers else ()))
    runs = []
    for i, peer in enumerate(peers):
        module = CausalLM(args.steps)
        strategy = SwarmStrategy(SwarmArguments(run_id="gpt2-lightning", target_batch_size=32 * args.peers,
                                                min_peers=args.peers), peer=peer, max_collective_steps=args.steps,
                                 max_grad_norm=1.0)
        loader = DataLoader(train, batch_size=16, sampler=strategy.sampler(len(train)))
        callbacks = []
        if i == 0:
            print(f"swarm step    0  held-out loss {held_out_loss(module.model, held_out):.3f}", flush=True)
            callbacks.append(PrintHeldOutLoss(held_out, max(1, args.steps // 6)))
        trainer = pl.Trainer(strategy=strategy, max_steps=100 * args.steps, accumulate_grad_batches=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks)
        runs.append((trainer, module, loader))
    threads = [threading.Thread(target=lambda r=r: r[0].fit(r[1], r[2])) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for peer in peers:
        peer.shutdown()


if __name__ == "__main__":
    main()
