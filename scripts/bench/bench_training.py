#!/usr/bin/env python
"""Benchmark: collaborative training of the demo model, peers as separate processes on loopback.

Two figures, each against a baseline measured in the same run:

1. bytes: bytes each peer sends for averaging, and wall time, until the held-out loss reaches
   `--target-loss`, with per-step gradient averaging (every local batch is a collective step,
   float32 on the wire) vs DiLoCo (H local Adam steps, then an outer Nesterov step on the
   8-bit-compressed averaged pseudo-gradient). Target: DiLoCo sends >= 50x fewer.
2. throughput: `--swarm-peers` trainers in large-batch mode on this box vs one plain
   PyTorch process (all cores) training the same model on the same data for the same wall time:
   samples per second and held-out loss at the end. Target: >= 0.7x, loss within 10%.

    .venv/bin/python scripts/bench/bench_training.py [--only bytes|throughput] [--target-loss 2.6]

The model is the demo's byte-level transformer (`swarm.demo.model`) with its mixture layer held
locally (`LocalExperts`), so that only the optimizer's traffic is counted; bytes are the tensor
bytes a peer puts on the wire in the butterfly all-reduce (2 (n-1)/n of the averaged vector per
round, at the wire size of the chosen compression).

`SWARM_BENCH_LOG=1` makes every swarm worker log to stderr how each group it led started (after
how long, and why) and each round's outcome: where a collective step's time goes.
`BENCH_PROFILE=1` (or `=FILE.prof`, kept whole) profiles the first trainer's event loop thread in
CPU time over its timed steps and prints the top functions to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

BATCH = 16
HELD_OUT = 64


# -- worker side ----------------------------------------------------------------------------------


def _setup(threads: int, hidden_dim: int = 128) -> tuple[Any, Any, Any]:
    import torch

    from swarm.demo.data import ByteDataset, load_corpus
    from swarm.demo.model import ByteLM, LocalExperts, ModelConfig

    torch.set_num_threads(threads)
    config = ModelConfig(hidden_dim=hidden_dim)
    torch.manual_seed(0)
    model = ByteLM(config, LocalExperts(config))
    train, held_out = ByteDataset.split(load_corpus(), config.context)
    return model, train, held_out.batch(HELD_OUT, torch.Generator().manual_seed(12345))


def _evaluate(model: Any, held_out: Any) -> float:
    import torch

    with torch.no_grad():
        return float(model.loss(*held_out))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far: the training thread, the peer's loop, executor
    threads, and threads Python does not know (gRPC's and OpenMP's, "native")."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")
        if name == "MainThread":
            name = "training"
        elif name.startswith("swarm-"):
            name = "peer loop"  # core.loop.LoopThread, named after its peer
        elif name.startswith(("ThreadPoolExecutor", "asyncio_")):
            name = "executor"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class FullCollections:
    """The garbage collector's full (generation 2) collections in this process from now on, each
    one's wall time: the pauses a trainer's loop takes for them (swarm/core/collector.py)."""

    def __init__(self) -> None:
        import gc

        self.pauses: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)

    def summary(self) -> list[float]:
        """[count, longest, total] in seconds, then the objects frozen out of them (`gc.freeze`)."""
        import gc

        return [len(self.pauses), max(self.pauses, default=0.0), sum(self.pauses), gc.get_freeze_count()]


def rpc_calls(peer: Any) -> dict[str, int]:
    """RPCs this peer served ("in ...") and made ("out ...") so far, by method (swarm.metrics.rpc)."""
    out: dict[str, int] = {}
    for side, owner in (("in", getattr(peer, "server", None)), ("out", getattr(peer, "pool", None))):
        metrics = getattr(owner, "metrics", None)
        for path, m in (metrics.methods.items() if metrics is not None else ()):
            out[f"{side} {path.rsplit('/', 1)[-1]}"] = int(m.ok.value + m.failed.value)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    model, train, held_out = _setup(args.threads, args.hidden_dim)
    gen = torch.Generator().manual_seed(1000 + args.index)
    adam = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    if args.mode == "plain":
        started, cpu_started = time.monotonic(), time.process_time()
        samples = 0
        while time.monotonic() - started < args.max_seconds:
            x, y = train.batch(args.batch, gen)
            adam.zero_grad()
            model.loss(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            adam.step()
            samples += args.batch
        elapsed = time.monotonic() - started
        cpu_s = time.process_time() - cpu_started
        print(json.dumps({"samples_per_s": samples / elapsed, "loss": _evaluate(model, held_out), "samples": samples,
                          "cpu_s": cpu_s, "steps": samples // args.batch}), flush=True)
        return

    if args.mode == "ddp":
        ddp_worker(args, model, train, held_out, gen, adam)
        return

    if os.environ.get("SWARM_BENCH_LOG"):
        import logging

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format=f"%(relativeCreated)d worker {args.index} %(name)s: %(message)s")
        logging.getLogger("swarm.averaging.matchmaking").setLevel(logging.DEBUG)
        logging.getLogger("swarm.optim").setLevel(logging.INFO)
    import swarm
    from swarm.compression import CompressionType
    from swarm.optim import CollaborationConfig, DiLoCoConfig

    if args.near_target is not None:  # A/B of waiting for a near target (`swarm.optim.optimizer.NEAR_TARGET`)
        import swarm.optim.optimizer

        swarm.optim.optimizer.NEAR_TARGET = args.near_target
    peer = swarm.Peer(listen=f"/ip4/{args.address}/tcp/0", initial_peers=args.initial_peers)
    print(peer.addrs[0], flush=True)
    collaboration = CollaborationConfig(
        target_batch_size=args.target_batch_size, report_period=0.1 if args.mode == "step" else 0.5,
        min_refresh_period=0.02, max_refresh_period=1.0, averaging_timeout=20.0, matchmaking_window=0.5,
        max_staleness=args.max_staleness, trial_step=not args.no_trial_step,
        **({} if args.gradient_compression is None else
           {"gradient_compression": CompressionType[args.gradient_compression]}))
    diloco = DiLoCoConfig(local_steps=args.local_steps, compression=CompressionType[args.compression],
                          fragments=args.fragments, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                          nesterov=args.outer_momentum > 0) if args.mode == "diloco" else None
    scheduler = _warmup(adam, args.warmup_steps)
    opt = swarm.Optimizer(peer, run_id=f"bench-{args.mode}", params=model.parameters(), optimizer=adam,
                          batch_size_per_step=BATCH, config=collaboration, diloco=diloco, scheduler=scheduler)
    if not opt.wait_for_peers(args.peers, timeout=120):
        raise SystemExit("the other peers did not show up")
    profiler = None
    if os.environ.get("BENCH_PROFILE") and args.index == 0:  # the first trainer's loop thread, in CPU time
        import cProfile

        profiler = cProfile.Profile(time.thread_time)

        async def toggle(on: bool) -> None:
            profiler.enable() if on else profiler.disable()

        peer.run(toggle(True))
    collections = FullCollections()
    started = time.monotonic()
    cpu_before = thread_cpu()
    rpcs_before = rpc_calls(peer)
    samples, reached, loss = 0, None, None
    compute = stepping = 0.0
    stop_at = started + args.max_seconds
    steps = state_loads = catch_ups = 0
    while time.monotonic() < stop_at and (not args.max_steps or steps < args.max_steps):
        steps += 1
        t0 = time.monotonic()
        x, y = train.batch(BATCH, gen)
        model.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.monotonic()
        out = opt.step()
        opt.zero_grad()
        state_loads += bool(out.state_loaded)
        catch_ups += bool(getattr(out, "caught_up", False))  # older revisions (compare_revisions) lack it
        compute, stepping = compute + t1 - t0, stepping + time.monotonic() - t1
        samples += BATCH
        evaluate_now = out.stepped and args.target_loss and opt.epoch % args.eval_every == 0
        if evaluate_now:
            # every peer holds the same parameters here, so every peer stops at the same epoch
            loss = _evaluate(model, held_out)
            if loss <= args.target_loss:
                reached = time.monotonic() - started
                break
    t0 = time.monotonic()
    before_flush = {"idle_s": opt.idle_seconds, "elapsed": t0 - started}
    opt.flush()  # the round in flight, if any, lands: every mode ends with all of its rounds applied
    stepping += time.monotonic() - t0
    elapsed = time.monotonic() - started
    cpu_after = thread_cpu()
    if profiler is not None:
        import pstats

        peer.run(toggle(False))
        if os.environ["BENCH_PROFILE"].endswith(".prof"):  # kept whole, for pstats or snakeviz
            profiler.dump_stats(os.environ["BENCH_PROFILE"])
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    cpu = {name: round(cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0), 2) for name in cpu_after}
    rpcs = {name: count - rpcs_before.get(name, 0) for name, count in rpc_calls(peer).items()}
    result = {"index": args.index, "mode": args.mode, "elapsed": elapsed, "compute_s": compute, "step_s": stepping,
              "idle_s": opt.idle_seconds, "cpu": cpu, "rpcs": rpcs, "state_loads": state_loads, "catch_ups": catch_ups, "before_flush": before_flush,
              "gc_full": collections.summary(),
              "staleness": sorted({r.staleness for r in opt.history if r.ok}), "seconds": reached if reached is not None else elapsed,
              "reached": reached is not None, "bytes_sent": opt.bytes_sent, "samples": samples,
              "samples_per_s": samples / elapsed, "epochs": opt.epoch, "loss": loss,
              "final_loss": _evaluate(model, held_out),
              "failed_rounds": sum(1 for r in opt.history if not r.ok)}
    print(json.dumps(result), flush=True)
    opt.shutdown()
    peer.shutdown()


def _warmup(optimizer: Any, steps: int) -> Any:
    """A linear learning-rate warm-up over the first `steps` optimizer steps (collective steps in
    large-batch mode, inner steps in DiLoCo), or None."""
    import torch

    if not steps:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps))


def ddp_worker(args: argparse.Namespace, model: Any, train: Any, held_out: Any, gen: Any, adam: Any) -> None:
    """One rank of synchronous data-parallel training with torch.distributed (gloo, over loopback):
    the same batch of 16 per process, local gradients clipped as a swarm trainer clips them, then
    one all-reduce of all of them (flattened) per step, and Adam on the mean. What the swarm's
    trainers would reach with an all-reduce that costs what gloo's does and no coordination at all:
    the bound their loss is measured against, on the same CPUs. A stop flag rides in the
    all-reduce, so every rank takes the same number of steps."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}", rank=args.index,
                            world_size=args.peers)
    params = [p for p in model.parameters() if p.requires_grad]
    scheduler = _warmup(adam, args.warmup_steps)
    sizes = [p.numel() for p in params]
    dist.barrier()
    started, cpu_before = time.monotonic(), thread_cpu()
    samples = steps = 0
    compute = 0.0
    while True:
        t0 = time.monotonic()
        x, y = train.batch(BATCH, gen)
        adam.zero_grad()
        model.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        compute += time.monotonic() - t0
        samples += BATCH
        for p in params:  # an expert no sample routed to has no gradient: it adds zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        done = torch.tensor([float(time.monotonic() - started >= args.max_seconds)])
        flat = torch.cat([*(p.grad.reshape(-1) for p in params), done])
        dist.all_reduce(flat)
        flat.div_(args.peers)
        for p, mean in zip(params, flat[:-1].split(sizes)):
            p.grad.copy_(mean.view_as(p))
        adam.step()
        if scheduler is not None:
            scheduler.step()
        steps += 1
        if flat[-1] > 0:  # some rank's time is up: all stop after this same step
            break
    elapsed = time.monotonic() - started
    cpu_after = thread_cpu()
    cpu = {name: round(cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0), 2) for name in cpu_after}
    print(json.dumps({"index": args.index, "mode": "ddp", "elapsed": elapsed, "compute_s": compute,
                      "step_s": elapsed - compute, "idle_s": 0.0, "cpu": cpu, "rpcs": {}, "state_loads": 0,
                      "staleness": [0], "samples": samples, "samples_per_s": samples / elapsed, "epochs": steps,
                      "final_loss": _evaluate(model, held_out), "failed_rounds": 0}), flush=True)
    dist.destroy_process_group()


# -- coordinator side -----------------------------------------------------------------------------


def run_workers(mode: str, peers: int, extra: list[str], timeout: float) -> list[dict[str, Any]]:
    """Starts `peers` worker processes (each after the first bootstraps from it); returns their results."""
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--peers", str(peers), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([*base, "--index", "0"], stdout=subprocess.PIPE, text=True, env=env)
    procs = [first]
    try:
        dials = mode not in ("plain", "ddp")  # ddp ranks meet at the port in `extra`
        addr = first.stdout.readline().strip() if dials else ""
        if dials and not addr.startswith("/"):
            raise RuntimeError(f"worker 0 did not start ({first.wait()})")
        for i in range(1, peers):
            procs.append(subprocess.Popen([*base, "--index", str(i), *(["--initial-peers", addr] if dials else [])],
                                          stdout=subprocess.PIPE, text=True, env=env))
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"a {mode} worker failed ({proc.returncode})")
            results.append(json.loads(lines[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def bench_bytes(args: argparse.Namespace) -> None:
    common = ["--target-loss", str(args.target_loss), "--max-seconds", str(args.max_seconds), "--threads", "1"]
    step = run_workers("step", args.peers, [*common, "--target-batch-size", str(BATCH * args.peers),
                                            "--eval-every", "5", "--gradient-compression", "NONE"],
                       args.max_seconds + 180)  # float32 on the wire: the uncompressed baseline
    diloco = run_workers("diloco", args.peers, [*common, "--local-steps", str(args.local_steps),
                                                "--eval-every", "1"], args.max_seconds + 180)
    for name, results in (("per-step averaging", step), ("diloco", diloco)):
        r = results[0]
        status = "reached" if all(x["reached"] for x in results) else "NOT reached"
        print(f"{name:<19} {args.peers} peers: {status} held-out loss <= {args.target_loss} in "
              f"{r['seconds']:.1f} s, {r['epochs']} collective steps, {r['samples']} samples per peer, "
              f"{statistics.mean(x['bytes_sent'] for x in results) / 1e6:.2f} MB sent per peer, "
              f"failed rounds {sum(x['failed_rounds'] for x in results)}", flush=True)
    step_bytes = statistics.mean(x["bytes_sent"] for x in step)
    diloco_bytes = statistics.mean(x["bytes_sent"] for x in diloco)
    both = all(x["reached"] for x in step + diloco)
    ratio = step_bytes / max(diloco_bytes, 1)
    print(f"bytes to reach loss {args.target_loss}: DiLoCo (H={args.local_steps}, 8-bit) sends {ratio:.0f}x fewer "
          f"bytes per peer than per-step averaging (target >= 50x){'' if both else ' [a run missed the target]'}; "
          f"wall time {diloco[0]['seconds']:.1f} s vs {step[0]['seconds']:.1f} s", flush=True)


def bench_throughput(args: argparse.Namespace) -> None:
    seconds = str(args.throughput_seconds)
    # the baseline is the better of one thread and all cores (OpenMP threads suffer on a busy box)
    plains = [(threads, run_workers("plain", 1, ["--max-seconds", seconds, "--threads", str(threads)],
                                    args.throughput_seconds + 120)[0])
              for threads in sorted({1, os.cpu_count() or 1})]
    for threads, result in plains:
        print(f"one plain process, {threads} thread(s): {result['samples_per_s']:.1f} samples/s, held-out loss "
              f"{result['loss']:.3f} after {args.throughput_seconds} s", flush=True)
    threads, plain = max(plains, key=lambda tr: tr[1]["samples_per_s"])
    swarm_results = run_workers("swarm", args.swarm_peers, [
        "--max-seconds", seconds, "--threads", "1", "--target-batch-size", str(args.swarm_target_batch)],
        args.throughput_seconds + 180)
    total = sum(r["samples_per_s"] for r in swarm_results)
    loss = swarm_results[0]["final_loss"]
    print(f"{args.swarm_peers} swarm trainers (target batch {args.swarm_target_batch}): {total:.1f} samples/s in all, "
          f"held-out loss {loss:.3f} after {args.throughput_seconds} s, "
          f"{swarm_results[0]['epochs']} collective steps", flush=True)
    print(f"throughput: {args.swarm_peers} trainers reach {total / plain['samples_per_s']:.2f}x one plain process "
          f"({threads} thread(s)) "
          f"(target >= 0.7x; hivemind 0.14-0.17x); held-out loss {loss / plain['loss']:.2f}x the plain process's "
          f"(target within 1.10x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["bytes", "throughput"], default=None)
    parser.add_argument("--peers", type=int, default=2, help="peers in the bytes figure")
    parser.add_argument("--target-loss", type=float, default=2.6, help="held-out loss to reach (nats per byte)")
    parser.add_argument("--local-steps", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="give up a run after this long")
    parser.add_argument("--throughput-seconds", type=int, default=60)
    parser.add_argument("--swarm-peers", type=int, default=4)
    parser.add_argument("--swarm-target-batch", type=int, default=256)
    # worker options
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["step", "diloco", "plain", "swarm", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--ddp-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--target-batch-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eval-every", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=3e-3, help=argparse.SUPPRESS)
    parser.add_argument("--max-staleness", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--no-trial-step", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compression", default="UNIFORM_8BIT", help=argparse.SUPPRESS)  # DiLoCo's outer codec
    parser.add_argument("--max-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--fragments", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--outer-lr", type=float, default=0.7, help=argparse.SUPPRESS)  # DiLoCo's outer SGD
    parser.add_argument("--outer-momentum", type=float, default=0.9, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)  # the plain process's batch
    # the model's width: 128 is the demo's (0.73M parameters), 480 about the overlap comparison's 9.8M
    parser.add_argument("--hidden-dim", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--near-target", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--gradient-compression", default=None, help=argparse.SUPPRESS)  # large-batch's wire codec
    args = parser.parse_args()
    if args.worker:
        if args.mode != "diloco" and args.target_batch_size is None:
            args.target_batch_size = BATCH
        if args.mode in ("swarm", "plain"):
            args.target_loss = 0.0
        worker(args)
        return
    if args.only in (None, "bytes"):
        bench_bytes(args)
    if args.only in (None, "throughput"):
        bench_throughput(args)


if __name__ == "__main__":
    main()
