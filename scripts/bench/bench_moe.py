"""MoE benchmark. One run on loopback, expert servers as separate processes:

  (a) one RemoteExpert ffn (hidden 1024), batch 256x1024 fp32: forward+backward calls/s, beside
      the same module's forward+backward+optimizer step run locally in this process (the baseline);
      goal: remote <= 1.25x local time (hivemind: ~2x);
  (b) RemoteMixtureOfExperts over a 2x2 grid, k_best=4, batch 256: samples/s, beside the local
      compute of the same four experts and gate; goals: >= 10x hivemind's ~60 samples/s,
      <= 1.3x local compute;
  (c) 8 concurrent clients (each its own peer) against one server, small batches: throughput
      with batching vs without (max_batch_tasks=1);
  (d) the answer checks' cost (`swarm.moe.client.answer_checks`): the mixture of (b), forward and
      backward, with the checks on vs off (`AnswerChecks(enabled=False)`), two mixtures over the same
      server alternating pair by pair; goal: on/off time <= 1.03x. Not in the default `--only`;
  (e) the spot checks' cost (`swarm.moe.client.spot_checks`): the mixture of (b), forward only (so
      that the two servers' copies of each expert stay identical), over two servers that both hold
      the grid, with spot checks of every batch (fraction 1) and of 10% of batches, each against
      no spot checks, alternating pair by pair; the ratio of total times (a fraction of the batches
      pays, so a median would hide it). Not in the default `--only`.

Each figure is measured over TLS (the default) and plaintext (`--insecure` on server and clients)
in the same run (--modes), lines prefixed [tls] / [plaintext].

Local and remote calls alternate one by one and each ratio is the median of the per-pair
ratios, because the machine is shared and its load moves within seconds. Each timed call starts
after a pause (--settle-ms): after a parallel region, libgomp's idle threads spin for ~20 ms, and
on one 2-core machine the client's spinning threads (after its local step) took a core from the
server's next forward, and the server's from the next local step (measured on (a): remote/local
1.22-1.28x without the pause, 1.14-1.16x with it, the local step unchanged); on two machines,
as in use, neither happens. The local baseline uses as many torch threads as the server's compute
threads and the servers' optimizer (`swarm.moe.server.experts.default_optimizer`). One line per figure.

Usage: .venv/bin/python scripts/bench/bench_moe.py [--hidden-dim 1024] [--batch 256] [--pairs 12]
         [--server-threads 1,2] [--clients 8] [--client-batch 32] [--seconds 8] [--only abc]
         [--settle-ms 50] [--modes tls,plaintext]
       .venv/bin/python scripts/bench/bench_moe.py --only d --modes plaintext [--pairs 40]
       .venv/bin/python scripts/bench/bench_moe.py --only e --modes plaintext [--pairs 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Self

os.environ.setdefault("PYTHONUNBUFFERED", "1")


def serve(args: argparse.Namespace) -> None:
    import torch

    from swarm.moe.server.config import ExpertServerConfig
    from swarm.moe.server.expert_server import ExpertServer
    from swarm.moe.server.hosted import BatchingConfig
    from swarm.peer import Peer

    torch.manual_seed(0)
    peer = Peer(listen="/ip4/127.0.0.1/tcp/0", insecure=args.insecure)
    config = ExpertServerConfig(
        batching=BatchingConfig(max_batch_tasks=args.max_batch_tasks), compute_threads=args.threads,
        checkpoint_interval=None,
    )
    ExpertServer.from_pattern(peer, args.experts, "ffn", args.hidden_dim, config=config)
    print(peer.addrs[0], flush=True)
    sys.stdin.read()
    peer.shutdown()


class Server:
    """A `--role server` process of this script; its address is `addr`."""

    def __init__(self, experts: str, hidden_dim: int, threads: int, max_batch_tasks: int | None = None,
                 insecure: bool = False) -> None:
        cmd = [sys.executable, __file__, "--role", "server", "--experts", experts, "--hidden-dim", str(hidden_dim),
               "--threads", str(threads), *(["--insecure"] if insecure else [])]
        if max_batch_tasks is not None:
            cmd += ["--max-batch-tasks", str(max_batch_tasks)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addr = self.proc.stdout.readline().strip()
        if not self.addr.startswith("/ip4/"):
            raise RuntimeError(f"server did not start: {self.addr!r}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def paired(
    local: Callable[[], None], remote: Callable[[], None], pairs: int, settle: float
) -> tuple[float, float, float]:
    """Times `local` and `remote` alternately, call by call, so both see the same load on a shared
    machine, each after `settle` seconds of pause (see the module docstring); returns (median
    local s, median remote s, median of the per-pair remote/local ratios)."""
    local()
    remote()
    local_times, remote_times = [], []
    for _ in range(pairs):
        for fn, times in ((local, local_times), (remote, remote_times)):
            time.sleep(settle)
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    ratios = [r / loc for r, loc in zip(remote_times, local_times)]
    return statistics.median(local_times), statistics.median(remote_times), statistics.median(ratios)


def local_step_fn(modules: list, optimizers: list, x, grad) -> Callable[[], None]:
    def step() -> None:
        for module, optimizer in zip(modules, optimizers):
            xx = x.detach().requires_grad_()
            module(xx).backward(grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def bench_expert(args: argparse.Namespace, client) -> None:
    import torch

    from swarm.moe import RemoteExpert
    from swarm.moe.server.experts import FeedforwardExpert, default_optimizer

    hid, batch = args.hidden_dim, args.batch
    x, grad = torch.randn(batch, hid), torch.randn(batch, hid)
    local = FeedforwardExpert(hid)
    local_step = local_step_fn([local], [default_optimizer(list(local.parameters()))], x, grad)
    for threads in args.server_threads:
        torch.set_num_threads(threads)  # the local baseline gets the same compute threads as the server
        with Server("ffn.0", hid, threads, insecure=args.insecure) as server:
            expert = RemoteExpert(client, "ffn.0", server.addr, forward_timeout=120, backward_timeout=120)
            loc, rem, ratio = paired(local_step, remote_step_fn(expert, x, grad), args.pairs, args.settle_ms / 1e3)
        print(f"[{args.mode}] (a) RemoteExpert ffn {batch}x{hid} fwd+bwd, torch threads={threads}: {1 / rem:.2f} calls/s "
              f"({rem * 1e3:.0f} ms) vs local fwd+bwd+step {1 / loc:.2f} calls/s ({loc * 1e3:.0f} ms): "
              f"remote/local time {ratio:.2f}x (goal <= 1.25x, hivemind ~2x)", flush=True)


def remote_step_fn(expert, x, grad) -> Callable[[], None]:
    def step() -> None:
        expert(x.detach().requires_grad_()).backward(grad)

    return step


def bench_mixture(args: argparse.Namespace, client_factory) -> None:
    import torch

    from swarm.moe import RemoteMixtureOfExperts
    from swarm.moe.server.experts import FeedforwardExpert, default_optimizer

    hid, batch = args.hidden_dim, args.batch
    x, grad = torch.randn(batch, hid), torch.randn(batch, hid)
    gate = torch.nn.Linear(hid, 4)
    experts = [FeedforwardExpert(hid) for _ in range(4)]
    optimizers = [default_optimizer(list(e.parameters())) for e in experts]  # the servers' optimizer
    gate_opt = torch.optim.Adam(gate.parameters(), lr=1e-3)

    def local_step() -> None:  # the same work done in one process: gate, 4 experts on every sample, steps
        xx = x.detach().requires_grad_()
        scores = gate(xx).split([2, 2], dim=-1)
        logits = torch.stack([scores[0][:, i] + scores[1][:, j] for i in range(2) for j in range(2)], 1)
        weights = logits.softmax(dim=1)
        y = sum(weights[:, e : e + 1] * experts[e](xx) for e in range(4))
        y.backward(grad)
        for opt in (*optimizers, gate_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

    threads = max(args.server_threads)
    torch.set_num_threads(threads)
    with Server("ffn.[0:2].[0:2]", hid, threads, insecure=args.insecure) as server:
        client = client_factory(server.addr)
        moe = RemoteMixtureOfExperts(client, in_features=hid, grid_size=(2, 2), uid_prefix="ffn.", k_best=4,
                                     forward_timeout=120, backward_timeout=120, cache_ttl=60)
        moe_opt = torch.optim.Adam(moe.parameters(), lr=1e-3)

        def remote_step() -> None:
            xx = x.detach().requires_grad_()
            moe(xx).backward(grad)
            moe_opt.step()
            moe_opt.zero_grad(set_to_none=True)

        loc, rem, ratio = paired(local_step, remote_step, args.pairs, args.settle_ms / 1e3)
        failures = moe.caller.failures
        client.shutdown()
    if failures:
        print(f"[{args.mode}] (b) WARNING: {failures} expert calls failed or were late; the figure below is not comparable")
    print(f"[{args.mode}] (b) RemoteMixtureOfExperts 2x2 k_best=4 batch {batch} hidden {hid}: {batch / rem:.0f} samples/s "
          f"(goal >= 600, 10x hivemind's ~60), torch threads={threads}, vs local compute {batch / loc:.0f} samples/s: "
          f"remote/local time {ratio:.2f}x (goal <= 1.3x)", flush=True)


def bench_concurrent(args: argparse.Namespace, client_factory) -> None:

    from swarm.moe import RemoteExpert

    hid, batch = args.hidden_dim, args.client_batch
    results = {}
    for label, max_batch_tasks in (("with batching", None), ("without batching", 1)):
        with Server("ffn.0", hid, max(args.server_threads), max_batch_tasks, insecure=args.insecure) as server:
            clients = [client_factory(None) for _ in range(args.clients)]
            experts = [RemoteExpert(c, "ffn.0", server.addr, forward_timeout=120, backward_timeout=120)
                       for c in clients]
            steps, elapsed = run_clients(experts, batch, hid, args.seconds)
            for c in clients:
                c.shutdown()
        results[label] = steps * batch / elapsed
        print(f"[{args.mode}] (c) {args.clients} concurrent clients, batch {batch} each, ffn hidden {hid}, {label}: "
              f"{results[label]:.0f} samples/s fwd+bwd", flush=True)
    print(f"[{args.mode}] (c) batching speed-up: {results['with batching'] / results['without batching']:.2f}x", flush=True)


def run_clients(experts: list, batch: int, hid: int, seconds: float) -> tuple[int, float]:
    """Each expert handle loops fwd+bwd in its own thread for `seconds`; returns (steps, elapsed)."""
    import torch

    done = [0] * len(experts)
    start, stop = threading.Barrier(len(experts) + 1), threading.Event()

    def work(i: int) -> None:
        x, grad = torch.randn(batch, hid), torch.randn(batch, hid)
        experts[i](x.detach().requires_grad_()).backward(grad)  # warms up the channel
        start.wait()
        while not stop.is_set():
            experts[i](x.detach().requires_grad_()).backward(grad)
            done[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(experts))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(done), time.perf_counter() - began


def bench_checks(args: argparse.Namespace, client_factory) -> None:
    import torch

    from swarm.moe import AnswerChecks, RemoteMixtureOfExperts

    hid, batch = args.hidden_dim, args.batch
    # fresh batches each step: one batch and gradient repeated push the experts' Adam steps one way
    # until their outputs grow by orders of magnitude (unlike training), and the checks then judge that
    batches = [(torch.randn(batch, hid), torch.randn(batch, hid)) for _ in range(8)]
    steps = iter(range(1 << 30))
    threads = max(args.server_threads)
    torch.set_num_threads(threads)
    with Server("ffn.[0:2].[0:2]", hid, threads, insecure=args.insecure) as server:
        client = client_factory(server.addr)
        mixtures = {
            enabled: RemoteMixtureOfExperts(client, in_features=hid, grid_size=(2, 2), uid_prefix="ffn.", k_best=4,
                                            forward_timeout=120, backward_timeout=120, cache_ttl=60,
                                            checks=AnswerChecks(enabled=enabled))
            for enabled in (False, True)
        }
        mixtures[True].gate.load_state_dict(mixtures[False].gate.state_dict())

        def step(enabled: bool) -> None:
            x, grad = batches[next(steps) % len(batches)]
            mixtures[enabled](x.detach().requires_grad_()).backward(grad)

        off, on, ratio = paired(lambda: step(False), lambda: step(True), args.pairs, args.settle_ms / 1e3)
        failures = sum(m.caller.failures for m in mixtures.values())
        clipped = mixtures[True].caller.guard.clipped_rows
        client.shutdown()
    if failures:
        print(f"[{args.mode}] (d) WARNING: {failures} expert calls failed or were late; the figure below is not comparable")
    print(f"[{args.mode}] (d) answer checks, RemoteMixtureOfExperts 2x2 k_best=4 batch {batch} hidden {hid} fwd+bwd: "
          f"on {batch / on:.0f} samples/s, off {batch / off:.0f} samples/s: on/off time {ratio:.3f}x (goal <= 1.03x), "
          f"{clipped} of {mixtures[True].caller.guard.checked_rows} honest rows clipped, "
          f"{mixtures[True].caller.misbehaviours} answers rejected", flush=True)


def bench_spot_checks(args: argparse.Namespace, client_factory) -> None:
    import torch

    from swarm.moe import RemoteMixtureOfExperts
    from swarm.moe.client.dispatch import DispatchPolicy
    from swarm.moe.client.mixture import MixtureConfig
    from swarm.moe.client.spot_checks import SpotCheckConfig
    from swarm.moe.sources import StaticExpertSource

    hid, batch = args.hidden_dim, args.batch
    batches = [torch.randn(batch, hid) for _ in range(8)]
    steps = iter(range(1 << 30))
    torch.set_num_threads(1)
    uids = [f"ffn.{i}.{j}" for i in range(2) for j in range(2)]
    with Server("ffn.[0:2].[0:2]", hid, 1, insecure=args.insecure) as first, \
            Server("ffn.[0:2].[0:2]", hid, 1, insecure=args.insecure) as second:
        client = client_factory(None)
        source = StaticExpertSource([(u, first.addr) for u in uids] + [(u, second.addr) for u in uids])
        policy = DispatchPolicy(forward_timeout=120, backward_timeout=120)
        mixtures = {
            fraction: RemoteMixtureOfExperts(client, MixtureConfig(
                in_features=hid, grid_size=(2, 2), uid_prefix="ffn.", k_best=4, cache_ttl=60, policy=policy,
                spot_checks=SpotCheckConfig(fraction=fraction, seed=0)), source=source)
            for fraction in (0.0, 1.0, 0.1)
        }
        for moe in mixtures.values():
            moe.gate.load_state_dict(mixtures[0.0].gate.state_dict())

        def step(fraction: float) -> None:
            with torch.no_grad():
                mixtures[fraction](batches[next(steps) % len(batches)])

        step(0.0)
        for fraction in (1.0, 0.1):
            step(fraction)
            spent = {0.0: 0.0, fraction: 0.0}  # totals, not medians: a fraction of batches pays, the rest do not
            for _ in range(args.pairs):
                for f in (0.0, fraction):
                    time.sleep(args.settle_ms / 1e3)
                    started = time.perf_counter()
                    step(f)
                    spent[f] += time.perf_counter() - started
            spot = mixtures[fraction].caller.spot
            print(f"[{args.mode}] (e) spot checks of {fraction:.0%} of batches, RemoteMixtureOfExperts 2x2 k_best=4 "
                  f"batch {batch} hidden {hid} forward, two servers, {args.pairs} alternating pairs: on "
                  f"{batch * args.pairs / spent[fraction]:.0f} samples/s, off {batch * args.pairs / spent[0.0]:.0f} "
                  f"samples/s: on/off total time {spent[fraction] / spent[0.0]:.3f}x; "
                  f"{spot.checked if spot else 0} answers compared, {spot.mismatches if spot else 0} mismatches",
                  flush=True)
        client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main")
    parser.add_argument("--experts", default="ffn.0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tasks", type=int)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=12, help="local/remote call pairs per figure")
    parser.add_argument("--server-threads", default="1,2")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--client-batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--only", default="abc", help="which figures to measure, e.g. 'a' or 'bc'")
    parser.add_argument("--settle-ms", type=float, default=50.0,
                        help="pause before each timed call of (a) and (b), so idle OpenMP threads stop spinning")
    parser.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="tls,plaintext", help="transports to measure, in order")
    args = parser.parse_args()
    if args.role == "server":
        return serve(args)
    args.server_threads = [int(t) for t in args.server_threads.split(",")]

    from swarm.peer import Peer

    for mode in args.modes.split(","):
        args.mode, args.insecure = mode, mode == "plaintext"

        def client_factory(bootstrap: str | None) -> Peer:
            return Peer(client_mode=True, initial_peers=[bootstrap] if bootstrap else [], insecure=args.insecure)

        client = client_factory(None)
        try:
            if "a" in args.only:
                bench_expert(args, client)
            if "b" in args.only:
                bench_mixture(args, client_factory)
            if "c" in args.only:
                bench_concurrent(args, client_factory)
            if "d" in args.only:
                bench_checks(args, client_factory)
            if "e" in args.only:
                bench_spot_checks(args, client_factory)
        finally:
            client.shutdown()


if __name__ == "__main__":
    main()
