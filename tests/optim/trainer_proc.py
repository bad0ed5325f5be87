"""A trainer process for fault tests: trains the tiny task with swarm.Optimizer until an epoch.

    python trainer_proc.py --seed 1 --epochs 6 --out params.pt [--initial-peers MADDR] [--die-in-round N]

Prints its address once ready, then `epoch N` after every collective step, and saves its
parameters to --out before exiting 0, after one line per round (`round EPOCH ok|failed SECONDS
STALENESS`) and `idle SECONDS` (how long its training loop waited for rounds). `--die-in-round N` SIGKILLs the process in the middle of
the first averaging round from its N-th on (0-based) in which it sends a chunk to a group, through
the averager's fault plan: a step that formed no group, or a group of one, sends nothing and so
passes the kill on to the next round.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from optim_task import DATA_SIZE, adam, loss_on, make_data, make_model

from swarm.averaging import Action, Averager, FaultPlan, FaultPoint
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.group_averaging import SwarmAverager
from swarm.peer import Peer

AVERAGING_TIMEOUT = 5.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True, help="wait for this many peers before training")
    parser.add_argument("--out", required=True)
    parser.add_argument("--die-in-round", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
    print(peer.addrs[0], flush=True)
    plan = FaultPlan()
    if args.die_in_round is not None:
        plan.add(FaultPoint.AFTER_CHUNKS_SENT, Action.KILL, after=1,
                 rounds=set(range(args.die_in_round, args.die_in_round + 1000)))
    # rounds overlap compute (max_staleness 1, the default)
    config = CollaborationConfig(target_batch_size=256, report_period=0.1, max_refresh_period=0.5,
                                 progress_expiration=2.0, averaging_timeout=AVERAGING_TIMEOUT, matchmaking_window=0.5)
    model = make_model()
    opt = Optimizer(peer, run_id="kill", params=model.parameters(), optimizer=adam, config=config,
                    averager_factory=lambda tensors, prefix: SwarmAverager(
                        Averager(peer, tensors, prefix=prefix, target_group_size=8, faults=plan), 4.0))
    if not opt.wait_for_peers(args.peers, timeout=30):
        raise SystemExit("the other peers did not show up")
    x, y = make_data()
    g = torch.Generator().manual_seed(args.seed)
    while opt.epoch < args.epochs:
        idx = torch.randint(0, DATA_SIZE, (16,), generator=g)
        loss_on(model, x[idx], y[idx]).backward()
        out = opt.step(16)
        opt.zero_grad()
        if out.stepped:
            print(f"epoch {opt.epoch}", flush=True)
    torch.save([t.detach() for t in opt.shared_tensors], args.out)  # (a round may be in flight)
    for r in opt.history:
        print(f"round {r.epoch} {'ok' if r.ok else 'failed'} {r.seconds:.3f} {r.staleness}", flush=True)
    print(f"idle {opt.idle_seconds:.3f}", flush=True)
    print("done", flush=True)
    opt.shutdown()
    peer.shutdown()


if __name__ == "__main__":
    main()
