"""transformers' `SwarmTrainer` on the examples' tiny GPT-2, as a peer of its own or, under `torchrun`,
as the ranks of one peer (the Trainer starts gloo; the swarm sees rank 0's peer only).

    python dist_hf_proc.py --out DIR --name N --steps S                       # prints its address first
    torchrun --nproc-per-node 2 dist_hf_proc.py --out DIR --name N --steps S --initial-peers MADDR

Each rank appends to DIR/<name>-r<rank>.jsonl, at each of its steps at which the swarm's step count
moved, the fingerprint of the shared tensors there; at the end a line with this rank's own samples,
the machine's samples the swarm optimizer took in (rank 0: `Optimizer.samples_total`) and the
sample counts of the other peers' progress reports it read. With --diloco it trains in DiLoCo mode
(3 inner steps a round; --steps counts the swarm's inner steps); with --save-steps N, a checkpoint
every N steps goes to DIR/<name>/; with --resume DIR, training resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt2_common import byte_corpus, tiny_gpt2
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from swarm.compression import CompressionType
from swarm.integrations.session import SwarmArguments
from swarm.integrations.transformers import SwarmTrainer
from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer
from swarm.optim.training_state import state_digest
from swarm.peer import Peer

BATCH = 8
COLLAB = CollaborationConfig(report_period=0.05, min_refresh_period=0.02, max_refresh_period=0.2,
                             averaging_timeout=10.0, max_staleness=0, gradient_compression=CompressionType.NONE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--min-peers", type=int, default=2)
    parser.add_argument("--diloco", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    in_job = "RANK" in os.environ
    # on its own it starts its peer here, to print the address before waiting for the job; the job's
    # rank 0 lets the trainer start it, as a user's script does
    peer = None if in_job else Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
    if peer is not None:
        print(peer.addrs[0], flush=True)
    train, _ = byte_corpus(32, limit=60_000)
    holder: dict[str, SwarmTrainer] = {}
    log = open(Path(args.out) / f"{args.name}-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 -- closed after train()
    seen: list[int] = []
    own = [0]
    last = [-1]

    class Record(TrainerCallback):
        def on_step_end(self, a: TrainingArguments, state: TrainerState, control: TrainerControl,
                        **kwargs: object) -> None:
            session = holder["trainer"].session
            assert session is not None
            own[0] += BATCH
            opt = session.optimizer
            if opt.epoch != last[0]:
                last[0] = opt.epoch
                log.write(json.dumps({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors)}) + "\n")
            swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
            if swarm_opt is not None:
                seen.extend(r.samples for r in swarm_opt.tracker.reports() if r.peer_id != swarm_opt.peer.peer_id)

        def on_train_end(self, a: TrainingArguments, state: TrainerState, control: TrainerControl,
                         **kwargs: object) -> None:
            session = holder["trainer"].session
            assert session is not None
            opt = session.optimizer  # the round in flight landed (SwarmTrainer's flush ran first)
            swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
            log.write(json.dumps({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors), "own": own[0],
                                  "machine": swarm_opt.samples_total if swarm_opt is not None else None,
                                  "seen": seen}) + "\n")

    training = TrainingArguments(
        output_dir=str(Path(args.out) / args.name), per_device_train_batch_size=BATCH, max_steps=args.steps,
        learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        dataloader_num_workers=0, logging_steps=1000)
    mode = ({"diloco": DiLoCoConfig(local_steps=3, compression=CompressionType.NONE)} if args.diloco
            else {"target_batch_size": 48})
    swarm = SwarmArguments(run_id="hf-job", **mode, collaboration=COLLAB, min_peers=args.min_peers,
                           peers_timeout=120, initial_peers=tuple(args.initial_peers), listen="/ip4/127.0.0.1/tcp/0")
    trainer = SwarmTrainer(model=tiny_gpt2(context=32), args=training, train_dataset=train, swarm=swarm, peer=peer,
                           callbacks=[Record()])
    holder["trainer"] = trainer
    trainer.train(resume_from_checkpoint=args.resume)
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
