"""Lightning's `SwarmStrategy` on the examples' tiny GPT-2, as a peer of its own or, under `torchrun`,
as the ranks of one peer (the strategy starts gloo; the swarm sees rank 0's peer only).

    python dist_lightning_proc.py --out DIR --name N --steps S                       # prints its address first
    torchrun --nproc-per-node 2 dist_lightning_proc.py --out DIR --name N --steps S --initial-peers MADDR

The command line and the log each rank writes: `dist_steps.py`. Checkpoints (--save-steps) are
DIR/<name>/checkpoint-<step>.ckpt.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from dist_steps import BATCH, Worker, parse_args
from gpt2_common import tiny_gpt2
from torch.utils.data import DataLoader

from swarm.integrations.lightning import SwarmStrategy


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2(context=32)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    args = parse_args()
    worker = Worker(args, "pl-job")
    strategy = SwarmStrategy(worker.swarm, peer=worker.peer, max_collective_steps=args.steps)
    sampler = strategy.sampler(len(worker.train))

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            assert strategy.session is not None
            worker.step(strategy.session.optimizer, len(batch["input_ids"]))

        def on_train_end(self, trainer, module) -> None:
            assert strategy.session is not None
            opt = strategy.session.optimizer
            opt.flush()  # the round in flight lands on every rank
            worker.end(opt, position=sampler.position, global_zero=trainer.is_global_zero)

    callbacks: list[pl.Callback] = [Record()]
    if args.save_steps:
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=worker.checkpoints, filename="checkpoint-{step}", auto_insert_metric_name=False,
            every_n_train_steps=args.save_steps, save_top_k=-1))
    trainer = pl.Trainer(strategy=strategy, max_steps=100, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(args.save_steps), callbacks=callbacks)
    trainer.fit(CausalLM(), DataLoader(worker.train, batch_size=BATCH, sampler=sampler), ckpt_path=args.resume)
    worker.finish()


if __name__ == "__main__":
    main()
