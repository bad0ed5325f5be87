#!/usr/bin/env python
"""Benchmark: byzantine trainers against plain and robust (CenteredClip) averaging.

Two figures, each against a baseline measured in the same run:

1. training: `--peers` trainers (separate processes on loopback) train the demo model
   (`swarm.demo.model`, its mixture layer held locally so that only averaging is shared) in
   large-batch mode for `--seconds`; 0, 1 or 2 of them attack (`swarm.demo.byzantine`,
   `--attack`). Reported: the held-out loss at the end, plain mean vs robust mode, next to the
   honest run's. Target: robust mode within 10% of the honest run's loss.
2. cost: `--peers` in-process averagers over a vector the size of the demo model's dense
   parameters, alternating plain and robust (verified) rounds `--rounds` times each: the median
   wall time of a round and the process CPU time per round. Target: robust <= 1.25x plain.

    .venv/bin/python scripts/bench/bench_byzantine.py [--only training|cost] [--seconds 60] [--attack sign_flip]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

BATCH = 16
HELD_OUT = 64


def _setup() -> tuple[Any, Any, Any]:
    import torch

    from swarm.demo.data import ByteDataset, load_corpus
    from swarm.demo.model import ByteLM, LocalExperts, ModelConfig

    torch.set_num_threads(1)
    config = ModelConfig()
    torch.manual_seed(0)
    model = ByteLM(config, LocalExperts(config))
    train, held_out = ByteDataset.split(load_corpus(), config.context)
    return model, train, held_out.batch(HELD_OUT, torch.Generator().manual_seed(12345))


# -- 1. training (worker processes) ---------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    import swarm
    from swarm.demo.byzantine import attack_gradients
    from swarm.optim import CollaborationConfig

    model, train, held_out = _setup()
    gen = torch.Generator().manual_seed(1000 + args.index)
    adam = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    peer = swarm.Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers)
    print(peer.addrs[0], flush=True)
    collaboration = CollaborationConfig(
        target_batch_size=BATCH * args.peers * 2, target_group_size=args.peers, report_period=0.25,
        min_refresh_period=0.05, max_refresh_period=1.0, averaging_timeout=30.0, matchmaking_window=1.0,
        aggregation=args.aggregation)
    opt = swarm.Optimizer(peer, run_id=f"byz-{args.tag}", params=model.parameters(), optimizer=adam,
                          batch_size_per_step=BATCH, config=collaboration)
    if not opt.wait_for_peers(args.peers, timeout=180):
        raise SystemExit("the other peers did not show up")
    attacker = args.index < args.byzantine
    started = time.monotonic()
    cpu0 = time.process_time()
    while time.monotonic() - started < args.seconds:
        x, y = train.batch(BATCH, gen)
        model.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if attacker:
            attack_gradients(model.parameters(), args.attack, gen)
        opt.step()
        opt.zero_grad()
    rounds = [r for r in opt.history if r.group_size > 1]
    result = {
        "index": args.index, "attacker": attacker, "loss": float(model.loss(*held_out).detach()),
        "epochs": opt.epoch, "rounds": len(rounds), "failed": sum(1 for r in rounds if not r.ok),
        "round_s": statistics.median([r.seconds for r in rounds if r.ok]) if any(r.ok for r in rounds) else None,
        "cpu_s": time.process_time() - cpu0,
    }
    print(json.dumps(result), flush=True)
    opt.shutdown()
    peer.shutdown()


def run_training(args: argparse.Namespace, byzantine: int, aggregation: str) -> list[dict[str, Any]]:
    tag = f"{aggregation}-{byzantine}-{os.getpid()}"
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--peers", str(args.peers), "--seconds",
            str(args.seconds), "--byzantine", str(byzantine), "--aggregation", aggregation, "--attack", args.attack,
            "--tag", tag]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*base, "--index", "0"], stdout=subprocess.PIPE, text=True, env=env)
    procs = [first]
    try:
        addr = first.stdout.readline().strip()
        if not addr.startswith("/"):
            raise RuntimeError(f"worker 0 did not start ({first.wait()})")
        for i in range(1, args.peers):
            procs.append(subprocess.Popen([*base, "--index", str(i), "--initial-peers", addr],
                                          stdout=subprocess.PIPE, text=True, env=env))
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=args.seconds + 300)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"a worker failed ({proc.returncode})")
            results.append(json.loads(lines[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def bench_training(args: argparse.Namespace) -> None:
    print(f"training: {args.peers} trainers, {args.seconds:.0f} s each, attack {args.attack}")
    print("byzantine  aggregation    honest-loss  epochs  rounds(failed)  round_s")
    honest_loss = None
    for case in args.cases:
        count, _, aggregation = case.partition(":")
        byzantine = int(count)
        results = run_training(args, byzantine, aggregation)
        honest = [r for r in results if not r["attacker"]]
        loss = statistics.mean(r["loss"] for r in honest)
        if byzantine == 0 and aggregation == "mean":
            honest_loss = loss
        rel = f"({loss / honest_loss:.2f}x honest)" if honest_loss else ""
        rounds = max(r["rounds"] for r in honest)
        failed = max(r["failed"] for r in honest)
        times = [r["round_s"] for r in honest if r["round_s"] is not None]
        print(f"{byzantine:9d}  {aggregation:13s}  {loss:11.3f} {rel:14s} {max(r['epochs'] for r in honest):6d}"
              f"  {rounds:6d}({failed})  {statistics.median(times) if times else float('nan'):7.3f}", flush=True)


# -- 2. cost (in-process averagers) ---------------------------------------------------------------


def bench_cost(args: argparse.Namespace) -> None:
    import torch

    from swarm.averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig
    from swarm.peer import Peer

    model, _, _ = _setup()
    numel = sum(p.numel() for p in model.dense_parameters())
    torch.set_num_threads(1)
    peers = [Peer(listen="/ip4/127.0.0.1/tcp/0") for _ in range(args.peers)]
    addrs = [p.addrs[0] for p in peers]
    roomy = MatchmakingConfig(min_round_timeout=20.0)
    configs = {
        "mean": AveragerConfig(matchmaking=roomy),
        "centered_clip": AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip"), matchmaking=roomy),
        "clip_unverified": AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip", verify=False),
                                          matchmaking=roomy),
        "mean_verified": AveragerConfig(allreduce=AllReduceConfig(verify=True), matchmaking=roomy),
    }
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen)
    tensors = [[base + 0.1 * torch.randn(numel, generator=gen)] for _ in peers]
    avgs = {name: [Averager(p, t, prefix=f"cost-{name}", target_group_size=len(peers), initial_group=addrs, config=c)
                   for p, t in zip(peers, tensors)] for name, c in configs.items()}
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for _ in range(args.rounds + 1):  # the first pair warms up
            for name in configs:
                out: list[Any] = [None] * len(peers)

                def run(i: int, name: str = name, out: list[Any] = out) -> None:
                    try:
                        out[i] = avgs[name][i].step(timeout=60.0)
                    except Exception as e:  # noqa: BLE001 - counted below
                        out[i] = e

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(peers))]
                c0, t0 = time.process_time(), time.monotonic()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(90)
                wall[name].append(time.monotonic() - t0)
                cpu[name].append(time.process_time() - c0)
                failed = [r for r in out if isinstance(r, Exception)]
                if failed:
                    print(f"  a {name} round failed: {failed[0]}")
        print(f"cost: {args.peers} in-process peers, {numel} floats ({numel * 4 / 1e6:.1f} MB), {args.rounds} rounds each")
        for name in configs:
            w, c = statistics.median(wall[name][1:]), statistics.median(cpu[name][1:])
            print(f"  {name:13s}  round {w:.3f} s  cpu {c:.3f} s per round (all peers)")
        for name in list(configs)[1:]:
            w = statistics.median(wall[name][1:]) / statistics.median(wall["mean"][1:])
            c = statistics.median(cpu[name][1:]) / statistics.median(cpu["mean"][1:])
            print(f"  {name} / mean: round time {w:.2f}x, cpu {c:.2f}x")
    finally:
        for group in avgs.values():
            for a in group:
                a.shutdown()
        for p in peers:
            p.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["training", "cost"])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--attack", default="sign_flip", choices=["x1000", "sign_flip", "random", "constant"])
    parser.add_argument("--cases", nargs="+", default=[f"{n}:{a}" for n in (0, 1, 2) for a in ("mean", "centered_clip")],
                        help="training runs as BYZANTINE:AGGREGATION, in order (the first 0:mean is the honest baseline)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--byzantine", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--aggregation", default="mean", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.only in (None, "cost"):
        bench_cost(args)
    if args.only in (None, "training"):
        bench_training(args)


if __name__ == "__main__":
    main()
