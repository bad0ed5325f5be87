"""Lightning's `SwarmStrategy` on the examples' tiny GPT-2, as a peer of its own or, under `torchrun`,
as the ranks of one peer (the strategy starts gloo; the swarm sees rank 0's peer only).

    python dist_lightning_proc.py --out DIR --name N --steps S                       # prints its address first
    torchrun --nproc-per-node 2 dist_lightning_proc.py --out DIR --name N --steps S --initial-peers MADDR

The user's script is the same in both cases. Each rank appends to DIR/<name>-r<rank>.jsonl, at each
of its batches at which the swarm's step count moved, the fingerprint of the shared tensors there;
at the end a line with this rank's own samples, its place in the data, the machine's samples the
swarm optimizer took in (rank 0: `Optimizer.samples_total`), the sample counts of the other
peers' progress reports it read, and whether Lightning takes it for global rank zero. With --diloco it trains in
DiLoCo mode (3 inner steps a round, and --steps counts the swarm's inner steps); with
--checkpoints DIR, a checkpoint every 2 optimizer steps goes there; with --resume FILE, training resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt2_common import byte_corpus, tiny_gpt2

from swarm.compression import CompressionType
from swarm.integrations.lightning import SwarmStrategy
from swarm.integrations.session import SwarmArguments
from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer
from swarm.optim.training_state import state_digest
from swarm.peer import Peer

BATCH = 8
COLLAB = CollaborationConfig(report_period=0.05, min_refresh_period=0.02, max_refresh_period=0.2,
                             averaging_timeout=10.0, max_staleness=0, gradient_compression=CompressionType.NONE)


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2(context=32)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--min-peers", type=int, default=2)
    parser.add_argument("--checkpoints")
    parser.add_argument("--resume")
    parser.add_argument("--diloco", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    in_job = "RANK" in os.environ
    # on its own it starts its peer here, to print the address before waiting for the job; the job
    # lets the strategy start it on rank 0, as a user's script does
    peer = None if in_job else Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
    if peer is not None:
        print(peer.addrs[0], flush=True)
    train, _ = byte_corpus(32, limit=60_000)
    log = open(Path(args.out) / f"{args.name}-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 -- closed at the end
    mode = ({"diloco": DiLoCoConfig(local_steps=3, compression=CompressionType.NONE)} if args.diloco
            else {"target_batch_size": 48})
    swarm = SwarmArguments(run_id="pl-job", **mode, collaboration=COLLAB, min_peers=args.min_peers,
                           peers_timeout=120, initial_peers=tuple(args.initial_peers), listen="/ip4/127.0.0.1/tcp/0")
    strategy = SwarmStrategy(swarm, peer=peer, max_collective_steps=args.steps)
    sampler = strategy.sampler(len(train))
    seen: list[int] = []
    own = [0]
    last = [-1]

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            session = strategy.session
            assert session is not None
            own[0] += len(batch["input_ids"])
            opt = session.optimizer
            if opt.epoch != last[0]:
                last[0] = opt.epoch
                log.write(json.dumps({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors)}) + "\n")
            swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
            if swarm_opt is not None:
                seen.extend(r.samples for r in swarm_opt.tracker.reports() if r.peer_id != swarm_opt.peer.peer_id)

        def on_train_end(self, trainer, module) -> None:
            session = strategy.session
            assert session is not None
            opt = session.optimizer
            opt.flush()  # the round in flight lands on every rank
            swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
            log.write(json.dumps({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors), "own": own[0],
                                  "machine": swarm_opt.samples_total if swarm_opt is not None else None,
                                  "seen": seen, "position": sampler.position,
                                  "global_zero": trainer.is_global_zero}) + "\n")

    callbacks: list[pl.Callback] = [Record()]
    if args.checkpoints:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=2, save_top_k=-1))
    trainer = pl.Trainer(strategy=strategy, max_steps=100, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(args.checkpoints), callbacks=callbacks)
    trainer.fit(CausalLM(), DataLoader(train, batch_size=BATCH, sampler=sampler), ckpt_path=args.resume)
    log.close()
    if peer is not None:
        peer.shutdown()
    print("done", flush=True)
    if in_job:  # gloo may abort a rank as the interpreter finalizes: dist_trainer_proc.py says why
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
