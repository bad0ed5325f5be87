"""What the integration workers of `test_distributed.py` share (`dist_hf_proc.py`,
`dist_lightning_proc.py`): the command line, the swarm's settings, and the log each rank writes.

A worker runs as a peer of its own or, under `torchrun`, as the ranks of one peer; the script is
the same. Each rank appends to DIR/<name>-r<rank>.jsonl, at each of its steps at which the swarm's
step count moved, the fingerprint of the shared tensors there; at the end a line with this rank's
own samples, the machine's samples the swarm optimizer took in (rank 0: `Optimizer.samples_total`),
the sample counts of the other peers' progress reports it read, and what the worker adds (its
place in the data, whether its framework takes it for global rank zero).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # gpt2_common, here and in the workers

from gpt2_common import byte_corpus

from swarm.compression import CompressionType
from swarm.integrations.session import SwarmArguments
from swarm.optim import CollaborationConfig, DiLoCoConfig, Optimizer
from swarm.optim.training_state import state_digest
from swarm.peer import Peer

BATCH = 8
COLLAB = CollaborationConfig(report_period=0.05, min_refresh_period=0.02, max_refresh_period=0.2,
                             averaging_timeout=10.0, max_staleness=0, gradient_compression=CompressionType.NONE)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, required=True, help="the swarm's steps (DiLoCo: its inner steps)")
    parser.add_argument("--min-peers", type=int, default=2)
    parser.add_argument("--diloco", action="store_true", help="DiLoCo mode, 3 inner steps a round")
    parser.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps, in DIR/<name>/")
    parser.add_argument("--resume", help="the checkpoint to resume from")
    return parser.parse_args()


class Worker:
    """One rank's side of a run: its peer (a process on its own starts it here and prints its
    address first, before waiting for the job; in a job, the integration starts it on rank 0, as
    a user's script lets it), the data, the swarm's settings, and the log."""

    def __init__(self, args: argparse.Namespace, run_id: str) -> None:
        torch.set_num_threads(1)
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.in_job = "RANK" in os.environ
        self.peer = None if self.in_job else Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
        if self.peer is not None:
            print(self.peer.addrs[0], flush=True)
        self.train, _ = byte_corpus(32, limit=60_000)
        mode: dict[str, Any] = ({"diloco": DiLoCoConfig(local_steps=3, compression=CompressionType.NONE)}
                                if args.diloco else {"target_batch_size": 48})
        self.swarm = SwarmArguments(run_id=run_id, **mode, collaboration=COLLAB, min_peers=args.min_peers,
                                    peers_timeout=120, initial_peers=tuple(args.initial_peers),
                                    listen="/ip4/127.0.0.1/tcp/0")
        self.checkpoints = Path(args.out) / args.name
        self._log = open(Path(args.out) / f"{args.name}-r{self.rank}.jsonl", "a", buffering=1)  # noqa: SIM115 -- closed by finish()
        self._seen: list[int] = []
        self._own = 0
        self._last = -1

    def step(self, opt: Any, samples: int) -> None:
        """After one of this rank's optimizer steps (`opt`: the session's optimizer)."""
        self._own += samples
        if opt.epoch != self._last:
            self._last = opt.epoch
            self._write({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors)})
        swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
        if swarm_opt is not None:
            self._seen.extend(r.samples for r in swarm_opt.tracker.reports() if r.peer_id != swarm_opt.peer.peer_id)

    def end(self, opt: Any, **extra: object) -> None:
        """At the end of training, after the round in flight landed."""
        swarm_opt = opt if isinstance(opt, Optimizer) else opt.swarm
        self._write({"epoch": opt.epoch, "digest": state_digest(opt.shared_tensors), "own": self._own,
                     "machine": swarm_opt.samples_total if swarm_opt is not None else None, "seen": self._seen,
                     **extra})

    def _write(self, record: dict[str, object]) -> None:
        self._log.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        self._log.close()
        if self.peer is not None:
            self.peer.shutdown()
        print("done", flush=True)
        if self.in_job:  # gloo may abort a rank as the interpreter finalizes: dist_trainer_proc.py says why
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
