"""A trainer of the demo model (small) for the multi-rank tests: one swarm peer per process, or per
`torchrun` job (`swarm.DistributedOptimizer`, gloo) when started by torchrun.

    python dist_trainer_proc.py --out DIR --epochs N --batch B [--initial-peers MADDR] [--diloco]
    torchrun --nproc-per-node 2 dist_trainer_proc.py ... --batch 5 3     # rank r's batch: the r-th

The peer (rank 0) prints its address once ready; every rank prints `rank R pid P`, then `epoch N`
after each collective step. Each rank appends to DIR/<name>-r<rank>.jsonl, at the first batch of
each epoch it reaches, the fingerprint of its shared tensors, its own samples so far and rank 0's
count of the machine's samples so far; and at the end a line with the sample counts of the other
peers' progress reports it read. A rank whose step fails (a local rank died) leaves the swarm and
exits 3; SIGTERM (torchrun stopping the job) makes it leave the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from swarm.core.signals import handle_stop_signals
from swarm.demo.data import ByteDataset
from swarm.demo.model import ByteLM, LocalExperts, ModelConfig
from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer
from swarm.optim.distributed import DistributedOptimizer
from swarm.optim.training_state import state_digest
from swarm.peer import Peer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch", type=int, nargs="+", required=True)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--identity", default=None)
    parser.add_argument("--diloco", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL between the ranks")
    parser.add_argument("--wait-rejoin", type=int, default=None,
                        help="at this epoch, wait for another peer to reach it (rejoin) before training on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stop = threading.Event()
    handle_stop_signals(lambda signum: stop.set())  # torchrun's SIGTERM: leave cleanly, then exit
    distributed = "RANK" in os.environ
    if distributed:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(1234 + rank)  # replicas start apart: the optimizer makes them one
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers,
                identity_path=args.identity) if rank == 0 else None
    if peer is not None:
        print(peer.addrs[0], flush=True)
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    config = ModelConfig(hidden_dim=32, context=16, heads=2)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = ByteLM(config, LocalExperts(config, count=1)).to(device)
    collab = CollaborationConfig(target_batch_size=48, report_period=0.1, max_refresh_period=0.5,
                                 progress_expiration=3.0, averaging_timeout=5.0, matchmaking_window=0.5)
    diloco = DiLoCoConfig(local_steps=4) if args.diloco else None

    def adam(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-3)

    opt: DistributedOptimizer | Optimizer
    if distributed:
        opt = DistributedOptimizer(peer, "dist", model.dense_parameters(), adam, diloco=diloco, config=collab)
        swarm_opt = opt.swarm
    else:
        assert peer is not None
        opt = swarm_opt = Optimizer(peer, "dist", model.dense_parameters(), adam, diloco=diloco, config=collab)
    if not opt.wait_for_peers(args.peers, timeout=60):
        raise SystemExit("the other peers did not show up")
    train, _ = ByteDataset.split(bytes(range(256)) * 64, config.context)
    g = torch.Generator().manual_seed(7 + rank)
    batch = args.batch[min(rank, len(args.batch) - 1)]
    with open(os.path.join(args.out, f"{args.name}-r{rank}.jsonl"), "a", buffering=1) as log:
        seen: list[int] = []
        own = 0
        code = 0
        epoch = -1
        try:
            while opt.epoch < args.epochs and not stop.is_set():
                if opt.epoch != epoch:  # the first batch at each epoch: what the ranks and peers hold alike
                    epoch = opt.epoch
                    machine = swarm_opt.samples_total if swarm_opt is not None else 0
                    log.write(json.dumps({"epoch": epoch, "digest": state_digest(opt.shared_tensors), "own": own,
                                          "machine": machine}) + "\n")
                    if epoch == args.wait_rejoin and swarm_opt is not None:  # a peer back at this epoch
                        deadline = time.monotonic() + 300
                        while not swarm_opt.tracker.peers_at(args.wait_rejoin):
                            if time.monotonic() > deadline:
                                raise SystemExit("no peer rejoined")
                            swarm_opt.tracker.wait_for(lambda _: False, 0.5)  # the next reads of the DHT
                x, y = train.batch(batch, g)
                model.loss(x.to(device), y.to(device)).backward()
                out = opt.step(batch)
                opt.zero_grad()
                own += batch
                if out.stepped:
                    print(f"epoch {opt.epoch}", flush=True)
                if swarm_opt is not None:
                    seen += [r.samples for r in swarm_opt.tracker.reports() if r.peer_id != swarm_opt.peer.peer_id]
        except (RuntimeError, dist.DistBackendError) as e:
            print(f"step failed: {type(e).__name__}", flush=True)
            code = 3
        log.write(json.dumps({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors), "seen": seen}) + "\n")
    opt.shutdown()
    if peer is not None:
        peer.shutdown()
    if distributed and code == 0:
        dist.destroy_process_group()
    print("done", flush=True)
    if distributed:
        # torch 2.13's gloo worker threads may free a finished collective's tensors while the
        # interpreter finalizes, and abort there ("terminate called without an active exception";
        # seen in 3 of 30 restarts, core dump: ProcessGroupGloo::AsyncWork's destructor taking the
        # GIL during Py_FinalizeEx). Everything is written and the swarm left: skip finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
