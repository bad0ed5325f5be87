"""One rank of a 2-rank gloo job (no torchrun: the rank and a file store come from the command
line) that starts a `SwarmSession` (or, with --lightning, a `SwarmStrategy`) whose rank 0 cannot join the swarm (its listen address is not a
multiaddr). Prints the error the session raised on this rank as `<rank> <type>: <message>`, then
stays in the job until its stdin closes: a rank 0 that lives on after its error (a framework that
catches it, a process kept up by other threads) is the case where the other ranks would wait for it
in a collective until the process group's timeout, rather than see its connection close."""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from swarm.core.errors import SwarmError
from swarm.integrations.session import SwarmArguments, SwarmSession


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="the process group's, in seconds")
    parser.add_argument("--lightning", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = torch.nn.Linear(4, 2)
    swarm = SwarmArguments(run_id="ranks", target_batch_size=4, listen="not-a-multiaddr")
    try:
        if args.lightning:
            from swarm.integrations.lightning import SwarmStrategy

            SwarmStrategy(swarm)
        else:
            SwarmSession(swarm, model, torch.optim.SGD(model.parameters(), lr=0.1))
    except SwarmError as e:  # what the session raises when a rank cannot join
        print(f"{args.rank} {type(e).__name__}: {e}", flush=True)
    else:
        print(f"{args.rank} started", flush=True)
    sys.stdin.read()  # until the test has read both ranks' lines
    dist.destroy_process_group()
    # torch 2.13's gloo can abort a rank as its interpreter finalizes ("terminate called without
    # an active exception"; 1 rank in 12 here, a core dump: a gloo worker thread destroying an
    # AsyncWork frees its tensors' Python objects and takes the GIL during Py_FinalizeEx), as in
    # docs/operations.md and tests/optim/dist_trainer_proc.py: everything is printed, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
