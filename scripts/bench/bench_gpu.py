"""Tensors on a CUDA device through swarm: averaging and a remote expert, each against its CPU twin
in the same run, with the worst stall of the peer's loop meanwhile.

- averaging: two peers in this process average `--mbytes` of float32 held on the GPU, then the same
  held on the CPU (seconds per round; the GPU's pays one copy each way through pinned memory);
- a remote expert: `RemoteExpert` forward and backward on a batch held on the GPU (the expert
  server in this process computes on the CPU: it does not move its inputs to a module's device),
  against the module run locally on the GPU.

    python scripts/bench/bench_gpu.py --rounds 5 --mbytes 100

Exits with an error when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.averaging import Averager
from swarm.core.loop_lag import LoopLag
from swarm.moe import ExpertServer, RemoteExpert
from swarm.moe.server.experts import FeedforwardExpert
from swarm.peer import Peer

LISTEN = "/ip4/127.0.0.1/tcp/0"


def bench_averaging(device: str, mbytes: float, rounds: int, peers: list[Peer], prefix: str) -> tuple[float, float]:
    numel = int(mbytes * 1e6 / 4)
    tensors = [torch.full((numel,), float(i), device=device) for i in range(2)]
    averagers = [Averager(p, [t], prefix=prefix, target_group_size=2) for p, t in zip(peers, tensors)]
    lags = [LoopLag(p.loop.loop) for p in peers]
    times = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(rounds):
            started = time.perf_counter()
            for f in [pool.submit(a.step, timeout=60) for a in averagers]:
                f.result(120)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    worst = max(lag.stop() for lag in lags)
    for a in averagers:
        a.shutdown()
    if not all(torch.allclose(t, torch.full_like(t, 0.5)) for t in tensors):
        raise SystemExit(f"averaging on {device} gave a wrong mean")
    return sorted(times)[len(times) // 2], worst


def bench_expert(batch: int, hidden: int, repeats: int) -> tuple[float, float, float]:
    module = FeedforwardExpert(hidden)
    local = FeedforwardExpert(hidden).cuda()
    with Peer(listen=LISTEN) as server_peer, Peer(listen=LISTEN, client_mode=True) as client:
        server = ExpertServer(server_peer, {"ffn.0.0": module},
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.0), declare=False)
        expert = RemoteExpert(client, "ffn.0.0", server_peer.addrs[0])
        x = torch.randn(batch, hidden, device="cuda")

        def timed(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
            times = []
            for _ in range(repeats):
                xi = x.clone().requires_grad_()
                torch.cuda.synchronize()
                started = time.perf_counter()
                fn(xi).sum().backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            return sorted(times)[len(times) // 2]

        timed(expert)  # warm-up: connections, kernels
        lag = LoopLag(client.loop.loop)
        remote = timed(expert)
        worst = lag.stop()
        local_time = timed(local)
        server.shutdown()
    return remote, local_time, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbytes", type=float, default=100.0, help="averaged tensor size, MB of float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device here (torch.cuda.is_available() is False)")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    with Peer(listen=LISTEN) as first, Peer(listen=LISTEN, initial_peers=first.addrs) as second:
        cpu_round, cpu_lag = bench_averaging("cpu", args.mbytes, args.rounds, [first, second], "cpu")
        gpu_round, gpu_lag = bench_averaging("cuda", args.mbytes, args.rounds, [first, second], "gpu")
    print(f"averaging {args.mbytes:.0f} MB, 2 peers, CPU tensors: {cpu_round:.3f} s per round (median), "
          f"worst loop stall {cpu_lag * 1e3:.0f} ms")
    print(f"averaging {args.mbytes:.0f} MB, 2 peers, CUDA tensors: {gpu_round:.3f} s per round (median), "
          f"{gpu_round / cpu_round:.2f}x the CPU's, worst loop stall {gpu_lag * 1e3:.0f} ms")
    remote, local, lag = bench_expert(args.batch, args.hidden_dim, args.repeats)
    print(f"RemoteExpert fwd+bwd {args.batch}x{args.hidden_dim}, CUDA inputs, expert server on the CPU: "
          f"{remote * 1e3:.1f} ms (median), {remote / local:.2f}x local GPU compute ({local * 1e3:.2f} ms), "
          f"worst client loop stall {lag * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
