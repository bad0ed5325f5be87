#!/usr/bin/env python
"""Benchmark: peers started the way a user starts them, averaging from a cold start.

Each run starts, as separate processes on loopback, a first peer and, as soon as it prints its
address, `--peers - 1` more given that address. Every process then runs, exactly as a user's
script would:

    peer = swarm.Peer(initial_peers=[first] or [], listen="/ip4/127.0.0.1/tcp/0")
    for r in range(rounds):
        t = torch.randn(numel)
        swarm.Averager(peer, [t], prefix=f"run-{r}", target_group_size=peers).step(timeout=60)

and leaves (`peer.shutdown()`) after its last round. Figures over all runs:
- left out: steps of healthy peers that raised (no peer is killed here, so every failed step is
  a healthy peer left out of its round);
- split rounds: rounds whose peers averaged in more than one group (none left out, but smaller
  groups than the peers could have formed);
- each failed step's error, and the seconds it took (a peer that missed its round's group learns
  it within about a round trip: it must not wait out its timeout).

    .venv/bin/python scripts/bench/bench_cold_start.py [--runs 50] [--peers 4] [--rounds 3]
        [--numel 25000000] [--budget 1800]

Prints one line per run and a summary; exits 1 if any healthy peer was left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any


def worker(first: str | None, numel: int, rounds: int, peers: int, step_timeout: float) -> None:
    import torch

    import swarm

    peer = swarm.Peer(initial_peers=[first] if first else [], listen="/ip4/127.0.0.1/tcp/0")
    print(peer.addrs[0], flush=True)
    for r in range(rounds):
        t = torch.randn(numel)
        began = time.time()
        line: dict[str, Any] = {"round": r, "peer": peer.peer_id[-8:], "began": began}
        try:
            result = swarm.Averager(peer, [t], prefix=f"run-{r}", target_group_size=peers).step(timeout=step_timeout)
            line.update(ok=True, group=result.round_id[:8], size=len(result.group))
        except swarm.SwarmError as e:  # every failure is the figure: report it, go on with the next round
            line.update(ok=False, error=f"{type(e).__name__}: {e}")
        line["seconds"] = round(time.time() - began, 3)
        print("RESULT " + json.dumps(line), flush=True)
    peer.shutdown()


@dataclass
class Run:
    steps: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if not s["ok"]]

    def split_rounds(self) -> list[int]:
        rounds: dict[int, set[str]] = {}
        for s in self.steps:
            rounds.setdefault(s["round"], set()).add(s["group"] if s["ok"] else f"failed-{s['peer']}")
        return sorted(r for r, groups in rounds.items() if len(groups) > 1)


def cold_start(peers: int, numel: int, rounds: int, step_timeout: float, deadline: float) -> Run:
    """One run: the first peer, then the others given its address as soon as it prints it."""
    cmd = [sys.executable, os.path.abspath(__file__), "--numel", str(numel), "--rounds", str(rounds),
           "--peers", str(peers), "--step-timeout", str(step_timeout), "--worker"]
    started = time.monotonic()
    procs = [subprocess.Popen([*cmd, "-"], stdout=subprocess.PIPE, text=True)]
    try:
        assert procs[0].stdout is not None
        first = procs[0].stdout.readline().strip()
        if not first.startswith("/"):
            raise RuntimeError(f"the first peer printed no address: {first!r}")
        procs += [subprocess.Popen([*cmd, first], stdout=subprocess.PIPE, text=True) for _ in range(peers - 1)]
        run = Run()
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            run.steps += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
            if p.returncode != 0:
                raise RuntimeError(f"a peer exited with {p.returncode}")
        if len(run.steps) != peers * rounds:
            raise RuntimeError(f"{len(run.steps)} steps reported, {peers * rounds} expected")
        run.seconds = time.monotonic() - started
        return run
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs="?", const="-", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--numel", type=int, default=25_000_000, help="float32 elements each peer averages")
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=1800.0, help="wall seconds for all runs at most")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(None if args.worker == "-" else args.worker, args.numel, args.rounds, args.peers, args.step_timeout)
        return 0
    deadline = time.monotonic() + args.budget
    left_out = splits = steps = done = 0
    for i in range(args.runs):
        if time.monotonic() >= deadline:
            print(f"budget of {args.budget:.0f} s spent after {done} run(s)")
            break
        try:
            run = cold_start(args.peers, args.numel, args.rounds, args.step_timeout, deadline)
        except subprocess.TimeoutExpired:  # the budget ran out inside a run (a peer waiting out its timeout)
            print(f"run {i}: cut short by the budget of {args.budget:.0f} s (its peers were killed)")
            break
        done += 1
        steps += len(run.steps)
        left_out += len(run.failed)
        split = run.split_rounds()
        splits += len(split)
        sizes = [sorted((s.get("size", 0) for s in run.steps if s["round"] == r), reverse=True)
                 for r in range(args.rounds)]
        print(f"run {i}: {run.seconds:.1f} s, left out {len(run.failed)}, split rounds {split or 'none'}, "
              f"group sizes by round {sizes}", flush=True)
        for s in run.failed:
            print(f"  round {s['round']} peer {s['peer']} failed after {s['seconds']:.2f} s: {s['error']}")
    print(f"cold starts: {done} runs of {args.peers} peers x {args.rounds} rounds, {args.numel} floats: "
          f"left out {left_out} of {steps} steps; split rounds {splits} of {done * args.rounds}")
    return 1 if left_out else 0


if __name__ == "__main__":
    sys.exit(main())
