"""A machine's ranks as one swarm peer (`swarm.DistributedOptimizer`) against one peer per process.

Both setups are the same invocation: a `torchrun --nproc-per-node K` job on the same cores, each
rank training the demo model on the same data with the same batch for the same number of steps,
and averaging with one more peer that stands for the rest of the swarm (it trains too, until the
job is done):

- baseline: each rank is its own one-process peer (`swarm.Optimizer`), so the swarm holds K + 1;
- distributed: the ranks are one peer (`swarm.DistributedOptimizer`: gloo here, NCCL with
  `--device cuda`), so the swarm holds two.

The ranks start together (a barrier after every peer is seen) and the machine's time is until the
last rank is done (a barrier again): samples/s is the machine's samples over that time. The
setups alternate, pair after pair (a change in the machine's load hits both alike); it prints each
pair's samples/s and ratio, then the bytes the machine sent across the swarm per collective step
(goal: at most half the baseline's) and the samples/s (goal: at least the baseline's), medians
over the pairs with the ratios' spread:

    python scripts/bench/bench_multigpu.py --steps 150 --repeats 5
    python scripts/bench/bench_multigpu.py --steps 400 --hidden-dim 256 --device cuda   # a GPU machine
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
REST_LIMIT = 600.0  # seconds: the rest-of-the-swarm peer stops by then even if the job never says done


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from swarm.demo.data import ByteDataset, load_corpus
    from swarm.demo.model import ByteLM, LocalExperts, ModelConfig
    from swarm.optim import CollaborationConfig, Optimizer
    from swarm.optim.distributed import DistributedOptimizer
    from swarm.peer import Peer

    torch.set_num_threads(1)
    in_job = "RANK" in os.environ
    cuda = args.device == "cuda"
    distributed = args.mode == "distributed"
    if in_job:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        # the baseline's ranks use the group only to start and end together
        dist.init_process_group("nccl" if cuda and distributed else "gloo")
    rank = dist.get_rank() if in_job else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", initial_peers=args.initial_peers) if (
        rank == 0 or not distributed) else None
    if peer is not None and not in_job:
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
    done_file = Path(args.done_file) if args.done_file else None
    if in_job:
        dist.barrier()
    started = time.monotonic()
    samples0 = swarm_opt.samples_total if swarm_opt is not None else 0
    bytes0 = swarm_opt.bytes_sent if swarm_opt is not None else 0
    averaged0 = _averaged(swarm_opt)
    for _ in range(args.steps if in_job else 10**9):
        if not in_job and done_file is not None and (done_file.exists() or time.monotonic() - started > REST_LIMIT):
            break
        x, y = train.batch(args.batch, g)
        model.loss(x.to(device), y.to(device)).backward()
        opt.step(args.batch)
        opt.zero_grad()
    if in_job:
        dist.barrier()
    seconds = time.monotonic() - started
    result = {"samples": swarm_opt.samples_total - samples0 if swarm_opt is not None else 0, "seconds": seconds,
              "bytes": swarm_opt.bytes_sent - bytes0 if swarm_opt is not None else 0,
              "averaged": _averaged(swarm_opt) - averaged0}
    if in_job and not distributed:  # the machine's figures: every peer's, on rank 0
        gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        result = {key: (max if key in ("seconds", "averaged") else sum)(r[key] for r in gathered if r is not None)
                  for key in result}
    if rank == 0 and in_job:
        print("RESULT " + json.dumps(result), flush=True)
    opt.shutdown()
    if peer is not None:
        peer.shutdown()
    if in_job:
        dist.destroy_process_group()


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
    base = ["--worker", "--batch", str(args.batch), "--hidden-dim", str(args.hidden_dim),
            "--target-batch", str(args.target_batch), "--device", args.device]
    name = "distributed" if distributed else "baseline"
    k = args.ranks
    peers = 2 if distributed else k + 1
    done = workdir / f"{name}.done"
    done.unlink(missing_ok=True)
    rest = _spawn([sys.executable, str(HERE), *base, "--seed", "9", "--peers", str(peers), "--done-file", str(done)],
                  workdir / f"{name}-rest.log")
    try:
        addr = _first_addr(rest, 120)
        job = _spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k),
                      str(HERE), *base, "--mode", name, "--steps", str(args.steps), "--seed", "1",
                      "--peers", str(peers), "--initial-peers", addr], workdir / f"{name}-job.log")
        results = _results(job, args.steps * 2.0 + 300)
    finally:
        done.touch()
    _results(rest, 120)
    if len(results) != 1:
        raise SystemExit(f"{name}: the job gave no result (logs in {workdir})")
    result = results[0]
    return {
        "samples_per_s": result["samples"] / result["seconds"],
        "bytes_per_step": result["bytes"] / max(result["averaged"], 1),
        "averaged": result["averaged"],
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs."""
    return {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps of each rank in each setup")
    parser.add_argument("--batch", type=int, default=16, help="samples per step of each process (rank)")
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--target-batch", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks of the job (one-process peers of the baseline)")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternated; medians reported")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("baseline", "distributed"), default="baseline", help=argparse.SUPPRESS)
    parser.add_argument("--done-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    bases, mines, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_multigpu.") as tmp:
        workdir = Path(tmp)
        for i in range(args.repeats):
            # alternated, each setup first in every other pair: a change in the machine's load hits both alike
            first, second = (False, True) if i % 2 == 0 else (True, False)
            figures = {first: run_setup(args, first, workdir), second: run_setup(args, second, workdir)}
            bases.append(figures[False])
            mines.append(figures[True])
            ratios.append(mines[-1]["samples_per_s"] / max(bases[-1]["samples_per_s"], 1e-9))
            print(f"pair {i + 1}: baseline {bases[-1]['samples_per_s']:.1f} samples/s, "
                  f"{args.ranks}-rank peer {mines[-1]['samples_per_s']:.1f} samples/s, ratio {ratios[-1]:.2f}x",
                  flush=True)
    base, mine = _median(bases), _median(mines)
    print(f"baseline ({args.ranks} one-process peers): {base['samples_per_s']:.1f} samples/s, "
          f"{base['bytes_per_step'] / 1e6:.2f} MB sent across the swarm per collective step "
          f"({base['averaged']:.0f} steps averaged, median of {args.repeats})")
    print(f"{args.ranks}-rank peer ({args.device}): {mine['samples_per_s']:.1f} samples/s, "
          f"{mine['bytes_per_step'] / 1e6:.2f} MB sent across the swarm per collective step "
          f"({mine['averaged']:.0f} steps averaged, median of {args.repeats})")
    bytes_ratio = mine["bytes_per_step"] / max(base["bytes_per_step"], 1.0)
    speed_ratio = sorted(ratios)[len(ratios) // 2]
    print(f"bytes per collective step: {bytes_ratio:.2f}x the baseline (goal <= 0.5): "
          f"{'met' if bytes_ratio <= 0.5 else 'missed'}")
    print(f"samples/s: {speed_ratio:.2f}x the baseline, median of the pairs' ratios (spread "
          f"{min(ratios):.2f}x to {max(ratios):.2f}x; goal >= 1.0): {'met' if speed_ratio >= 1.0 else 'missed'}")


if __name__ == "__main__":
    main()
