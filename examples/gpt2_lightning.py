"""Three local peers train one GPT-2-architecture model with PyTorch Lightning's Trainer, in a swarm.

    python examples/gpt2_lightning.py [--steps 60]

The `LightningModule` is an ordinary one; the swarm is `Trainer(strategy=SwarmStrategy(...))` and the
strategy's sampler in the DataLoader. The three peers run as threads of this process, on loopback;
on three machines, run the same script on each with `SWARM_INITIAL_PEERS` set. Same model and corpus
as `gpt2_trainer.py`; it prints the held-out loss as the swarm's step count grows.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))

from gpt2_common import HeldOutPrinter, byte_corpus, example_arguments, local_peers, tiny_gpt2, train_together

from swarm.integrations.lightning import SwarmStrategy
from swarm.integrations.session import SwarmArguments


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
    def __init__(self, printer: HeldOutPrinter) -> None:
        self.printer = printer

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.printer.at_step(trainer.strategy.global_step)


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Runs the example; returns the held-out losses it printed."""
    args = example_arguments(__doc__.splitlines()[0], argv)
    train, held_out = byte_corpus(64, limit=args.limit)
    peers = local_peers(args.peers)
    fits = []
    for i, peer in enumerate(peers):
        module = CausalLM(args.steps)
        strategy = SwarmStrategy(SwarmArguments(run_id="gpt2-lightning", target_batch_size=32 * args.peers,
                                                min_peers=args.peers), peer=peer, max_collective_steps=args.steps,
                                 max_grad_norm=1.0)
        loader = DataLoader(train, batch_size=16, sampler=strategy.sampler(len(train)))
        callbacks = []
        if i == 0:
            printer = HeldOutPrinter(module.model, held_out, args.steps // 6)
            callbacks.append(PrintHeldOutLoss(printer))
        trainer = pl.Trainer(strategy=strategy, max_steps=100 * args.steps, accumulate_grad_batches=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks)
        fits.append(lambda t=trainer, m=module, d=loader: t.fit(m, d))
    train_together(peers, fits)
    return printer.losses


if __name__ == "__main__":
    main()
