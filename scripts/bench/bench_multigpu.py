"""A machine's ranks as one swarm peer (`swarm.DistributedOptimizer`) against one peer per process.

Both setups run on the same cores, train the demo model on the same data with the same batch per
process, and average with one more peer that stands for the rest of the swarm (it trains too):

- baseline: two one-process peers (`swarm.Optimizer`), so the swarm holds three peers;
- distributed: one `torchrun --nproc-per-node 2` job (gloo here, NCCL with `--device cuda`), one
  peer, so the swarm holds two.

For the machine's processes it prints the bytes they sent across the swarm per collective step
(goal: at most half the baseline's) and their samples/s (goal: at least the baseline's), one line
per figure, then the ratios:

    python scripts/bench/bench_multigpu.py --seconds 20 --repeats 3
    python scripts/bench/bench_multigpu.py --seconds 60 --hidden-dim 128 --device cuda   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from swarm.demo.data import ByteDataset, load_corpus
    from swarm.demo.model import ByteLM, LocalExperts, ModelConfig
    from swarm.optim import CollaborationConfig, Optimizer
    from swarm.optim.distributed import DistributedOptimizer
    from swarm.peer import Peer

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    cuda = args.device == "cuda"
    if distributed:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers) if rank == 0 else None
    if peer is not None:
        print(peer.addrs[0], flush=True)
    torch.manual_seed(0)
    config = ModelConfig(hidden_dim=args.hidden_dim, context=32, heads=4)
    model = ByteLM(config, LocalExperts(config, count=1)).to(device)
    collab = CollaborationConfig(target_batch_size=args.target_batch, report_period=0.2, averaging_timeout=10.0,
                                 matchmaking_window=0.5)

    def adam(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=1e-3)

    opt: Optimizer | DistributedOptimizer
    if distributed:
        opt = DistributedOptimizer(peer, "bench", model.dense_parameters(), adam, config=collab)
        swarm_opt = opt.swarm
    else:
        assert peer is not None
        opt = swarm_opt = Optimizer(peer, "bench", model.dense_parameters(), adam, config=collab)
    if not opt.wait_for_peers(args.peers, timeout=300):
        raise SystemExit("the other peers did not show up")
    train, _ = ByteDataset.split(load_corpus(), config.context)
    g = torch.Generator().manual_seed(100 + args.seed * 10 + rank)
    # the ranks agree on when to stop (rank 0's clock), so they take the same number of steps
    stop_at = torch.tensor([time.time() + args.seconds], dtype=torch.float64, device=device)
    if distributed:
        dist.broadcast(stop_at, 0)
    started = time.monotonic()
    samples0 = swarm_opt.samples_total if swarm_opt is not None else 0
    bytes0 = swarm_opt.bytes_sent if swarm_opt is not None else 0
    averaged0 = _averaged(swarm_opt)
    steps = 0
    while True:
        done = torch.tensor([float(time.time() >= float(stop_at))], device=device)
        if distributed:
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if float(done):
            break
        x, y = train.batch(args.batch, g)
        model.loss(x.to(device), y.to(device)).backward()
        opt.step(args.batch)
        opt.zero_grad()
        steps += 1
    seconds = time.monotonic() - started
    if swarm_opt is not None:
        print("RESULT " + json.dumps({
            "samples": swarm_opt.samples_total - samples0, "seconds": seconds,
            "bytes": swarm_opt.bytes_sent - bytes0, "averaged": _averaged(swarm_opt) - averaged0,
            "epoch": swarm_opt.epoch}), flush=True)
    opt.shutdown()
    if peer is not None:
        peer.shutdown()


def _averaged(opt: object) -> int:
    from swarm.optim import Optimizer

    if not isinstance(opt, Optimizer):
        return 0
    return sum(1 for r in opt.history if r.ok and r.group_size > 1)


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)


def _first_addr(proc: subprocess.Popen[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited before it printed its address ({proc.wait()})")
        if line.startswith("/ip4/"):
            return line.strip()
    raise SystemExit("a worker did not print its address in time")


def _results(proc: subprocess.Popen[str], timeout: float) -> list[dict[str, float]]:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def run_setup(args: argparse.Namespace, distributed: bool, workdir: Path) -> dict[str, float]:
    base = [sys.executable, str(HERE), "--worker", "--seconds", str(args.seconds), "--batch", str(args.batch),
            "--hidden-dim", str(args.hidden_dim), "--target-batch", str(args.target_batch),
            "--device", args.device]
    name = "distributed" if distributed else "baseline"
    k = args.ranks
    peers = 2 if distributed else args.ranks + 1
    rest = _spawn([*base, "--seed", "9", "--peers", str(peers)], workdir / f"{name}-rest.log")
    addr = _first_addr(rest, 120)
    if distributed:
        machine = [_spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k),
                           str(HERE), "--worker", *base[3:], "--seed", "1", "--peers", str(peers),
                           "--initial-peers", addr], workdir / f"{name}-job.log")]
    else:
        machine = [_spawn([*base, "--seed", str(i + 1), "--peers", str(peers), "--initial-peers", addr],
                          workdir / f"{name}-p{i}.log") for i in range(k)]
    timeout = args.seconds + 300
    results = [r for p in machine for r in _results(p, timeout)]
    _results(rest, timeout)
    if len(results) != len(machine):
        raise SystemExit(f"{name}: a worker gave no result (logs in {workdir})")
    averaged = max(r["averaged"] for r in results)
    return {
        "samples_per_s": sum(r["samples"] / r["seconds"] for r in results),
        "bytes_per_step": sum(r["bytes"] for r in results) / max(averaged, 1),
        "averaged": averaged,
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs."""
    return {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="training time of each setup")
    parser.add_argument("--batch", type=int, default=16, help="samples per step of each process (rank)")
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--target-batch", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks of the job (one-process peers of the baseline)")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternated; medians reported")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    bases, mines = [], []
    with tempfile.TemporaryDirectory(prefix="bench_multigpu.") as tmp:
        workdir = Path(tmp)
        for i in range(args.repeats):  # alternated, so that a change in the machine's load hits both alike
            bases.append(run_setup(args, False, workdir))
            mines.append(run_setup(args, True, workdir))
            print(f"pair {i + 1}: baseline {bases[-1]['samples_per_s']:.1f} samples/s, "
                  f"{args.ranks}-rank peer {mines[-1]['samples_per_s']:.1f} samples/s", flush=True)
    base, mine = _median(bases), _median(mines)
    print(f"baseline ({args.ranks} one-process peers): {base['samples_per_s']:.1f} samples/s, "
          f"{base['bytes_per_step'] / 1e6:.2f} MB sent across the swarm per collective step "
          f"({base['averaged']:.0f} steps averaged, median of {args.repeats})")
    print(f"{args.ranks}-rank peer ({args.device}): {mine['samples_per_s']:.1f} samples/s, "
          f"{mine['bytes_per_step'] / 1e6:.2f} MB sent across the swarm per collective step "
          f"({mine['averaged']:.0f} steps averaged, median of {args.repeats})")
    bytes_ratio = mine["bytes_per_step"] / max(base["bytes_per_step"], 1.0)
    speed_ratio = mine["samples_per_s"] / max(base["samples_per_s"], 1e-9)
    print(f"bytes per collective step: {bytes_ratio:.2f}x the baseline (goal <= 0.5): "
          f"{'met' if bytes_ratio <= 0.5 else 'missed'}")
    print(f"samples/s: {speed_ratio:.2f}x the baseline (goal >= 1.0): {'met' if speed_ratio >= 1.0 else 'missed'}")


if __name__ == "__main__":
    main()
