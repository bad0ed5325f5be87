"""A trainer process for cold-restart tests: the tiny task with `swarm.Optimizer` saving a checkpoint
after every collective step into a directory the trainers share (`--dir`), optionally resuming
from it (`--resume`) or from another source (`--resume-from`: archivers' PeerIDs, a multiaddr).

    python checkpoint_proc.py [--dir DIR] --peers N [--resume | --resume-from SOURCE]
        [--initial-peers MADDR] [--seed N]

Prints its address once ready, then ``start EPOCH SHA256`` (the epoch it starts at and the sha256
of its parameters' bytes), waits for N peers, then prints ``epoch N`` after every collective step
and trains until killed.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from optim_task import DATA_SIZE, adam, loss_on, make_data, make_model

from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.checkpointing import CheckpointConfig
from swarm.peer import Peer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--resume", action="store_true", help="resume from --dir")
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--peers", type=int, required=True, help="wait for this many peers before training")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
    print(peer.addrs[0], flush=True)
    config = CollaborationConfig(target_batch_size=96, report_period=0.1, max_refresh_period=0.5,
                                 progress_expiration=2.0, averaging_timeout=5.0, matchmaking_window=0.5,
                                 max_staleness=0)
    model = make_model(seed=args.seed)  # each its own initial weights: a restart must replace them
    opt = Optimizer(peer, run_id="cold", params=model.parameters(), optimizer=adam, config=config,
                    checkpoint=CheckpointConfig(args.dir, every_epochs=1, keep=3) if args.dir else None,
                    resume_from=args.dir if args.resume else args.resume_from)
    params = b"".join(p.detach().numpy().tobytes() for p in opt.shared_tensors)
    print(f"start {opt.epoch} {hashlib.sha256(params).hexdigest()}", flush=True)
    if not opt.wait_for_peers(args.peers, timeout=60):
        raise SystemExit("the other peers did not show up")
    x, y = make_data()
    g = torch.Generator().manual_seed(args.seed)
    last = opt.epoch
    while True:
        idx = torch.randint(0, DATA_SIZE, (16,), generator=g)
        loss_on(model, x[idx], y[idx]).backward()
        opt.step(16)
        opt.zero_grad()
        if opt.epoch != last:
            last = opt.epoch
            print(f"epoch {opt.epoch}", flush=True)


if __name__ == "__main__":
    main()
