#!/usr/bin/env python
"""Network lab: the GPT-2 example's model under transformers' Trainer (`SwarmTrainer`), DiLoCo with
overlapped rounds, on `--peers` lab hosts against the same run on loopback, in one invocation.

Each trainer is a process on its own lab host (`--mbit` each way, `--delay-ms` one way: a 50 ms
round trip between two hosts by default), 1 torch thread, a GPT-2-architecture model of
`--layers` x `--width` (random init, byte vocabulary: ~10.7M parameters by default), DiLoCo with
H = `--local-steps` and each round averaging while the next H inner steps compute (max_staleness 1),
`--steps` inner steps (the Trainer's `max_steps`, the swarm's count). Then the same on loopback.

Figures, one line each: the share of each trainer's wall time spent computing (not waiting for its
group), from its first step to its last (the final flush of the last round, which nothing can
overlap, is shown apart), goal >= 95%; the held-out loss of the outer (shared) parameters after the
run, lab over loopback, goal within 1.05x.

    .venv/bin/python scripts/bench/lab_integrations.py [--steps 16] [--local-steps 4] [--peers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def worker(args: argparse.Namespace) -> None:
    """One trainer: prints its address (the first line), then one JSON line of figures."""
    import logging
    import tempfile

    import torch
    from gpt2_common import byte_corpus, held_out_loss, tiny_gpt2
    from transformers import TrainerCallback, TrainingArguments

    from swarm.compression import CompressionType
    from swarm.integrations.session import SwarmArguments
    from swarm.integrations.transformers import SwarmTrainer
    from swarm.optim import CollaborationConfig, DiLoCoConfig
    from swarm.peer import Peer

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    train, held_out = byte_corpus(args.context, limit=args.limit)
    peer = Peer(listen=f"/ip4/{args.address}/tcp/0", initial_peers=args.initial_peers)
    print(peer.addrs[0], flush=True)
    model = tiny_gpt2(args.layers, args.width, heads=args.heads, context=args.context)
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if "start" not in marks:  # the session is up and every peer joined: idle counts from here
                marks.update(start=time.monotonic(), idle0=trainer.session.optimizer.idle_seconds)

        def on_step_end(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.update(last=time.monotonic(), idle=trainer.session.optimizer.idle_seconds)

        def on_train_end(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            opt = trainer.session.optimizer
            opt.flush()
            marks.update(flushed=time.monotonic(), epoch=opt.epoch)
            marks["shared"] = [t.detach().clone() for t in opt.shared_tensors]  # type: ignore[assignment]

    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="lab-integrations-"), per_device_train_batch_size=args.batch,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10_000)
    swarm = SwarmArguments(
        run_id="lab-integrations", diloco=DiLoCoConfig(local_steps=args.local_steps,
                                                      compression=CompressionType[args.compression]),
        collaboration=CollaborationConfig(max_staleness=1, load_state_on_start=False),
        min_peers=args.peers, peers_timeout=300)
    trainer = SwarmTrainer(model=model, args=training, train_dataset=train, swarm=swarm, peer=peer,
                           callbacks=[Clock()])
    trainer.train()
    outer = tiny_gpt2(args.layers, args.width, heads=args.heads, context=args.context)
    with torch.no_grad():
        for p, value in zip(outer.parameters(), marks.pop("shared")):  # type: ignore[call-overload]
            p.copy_(value)
    elapsed = marks["last"] - marks["start"]
    print(json.dumps({"elapsed": elapsed, "idle": marks["idle"] - marks["idle0"], "flush": marks["flushed"] - marks["last"],
                      "epoch": marks["epoch"], "loss": held_out_loss(outer, held_out),
                      "params": sum(p.numel() for p in model.parameters())}), flush=True)
    peer.shutdown()


def run(spawn: Any, address: Any, args: argparse.Namespace, timeout: float) -> list[dict[str, Any]]:
    """Starts `--peers` workers (`spawn(i, argv)`; the first prints its address), returns their figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    common = ["--worker", "--steps", str(args.steps), "--local-steps", str(args.local_steps), "--peers", str(args.peers),
              "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads), "--batch",
              str(args.batch), "--context", str(args.context), "--lr", str(args.lr), "--limit", str(args.limit),
              "--compression", args.compression]

    def argv(i: int, *more: str) -> list[str]:
        return ["nice", "-n", str(args.nice), sys.executable, str(Path(__file__).resolve()), *common, "--address",
                address(i), *more]

    procs = [spawn(0, argv(0), env)]
    try:
        first = procs[0].stdout.readline().decode().strip()
        if not first.startswith("/"):
            raise RuntimeError(f"worker 0 did not start ({procs[0].wait()})")
        procs += [spawn(i, argv(i, "--initial-peers", first), env) for i in range(1, args.peers)]
        deadline = time.monotonic() + timeout
        return [figures(proc, deadline) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def figures(proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """The JSON line a worker ends with (RuntimeError if it failed), waiting until `deadline` at most."""
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    last = ([line for line in out.decode().splitlines() if line.startswith("{")] or [""])[-1]
    if proc.returncode != 0 or not last:
        raise RuntimeError(f"a worker failed ({proc.returncode})")
    return json.loads(last)


def summary(name: str, results: list[dict[str, Any]]) -> dict[str, float]:
    busy = [1 - r["idle"] / r["elapsed"] for r in results]
    loss = statistics.mean(r["loss"] for r in results)
    print(f"{name}: computing (not waiting for its group) {min(busy):.1%}-{max(busy):.1%} of each trainer's wall time "
          f"from its first step to its last, then {statistics.mean(r['flush'] for r in results):.1f} s for the last "
          f"round; outer held-out loss {loss:.4f} after {results[0]['epoch']} rounds; "
          f"{statistics.mean(r['elapsed'] for r in results):.0f} s of steps; {results[0]['params'] / 1e6:.1f}M "
          f"parameters", flush=True)
    return {"compute": min(busy), "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="inner steps per trainer (max_steps)")
    parser.add_argument("--local-steps", type=int, default=4, help="DiLoCo's H")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", type=int, default=300_000, help="corpus bytes used")
    parser.add_argument("--compression", default="UNIFORM_8BIT", help="the pseudo-gradients' codec")
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=12.5, help="one way per host link (x4: the round trip)")
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=args.delay_ms)
    print(f"lab integrations: {args.peers} SwarmTrainer peers, each host {args.mbit:g} Mbit/s each way, "
          f"{4 * args.delay_ms:g} ms round trip; load average {os.getloadavg()}", flush=True)
    with Lab([HostSpec(f"h{i}", link) for i in range(args.peers)], seed=1) as lab:
        in_lab = summary(f"lab, DiLoCo H={args.local_steps}, rounds overlapped", run(
            lambda i, argv, env: lab.spawn(f"h{i}", argv, env=env), lambda i: lab.address(f"h{i}"), args, args.timeout))

    def local(i: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)

    loopback = summary(f"loopback, DiLoCo H={args.local_steps}, rounds overlapped",
                       run(local, lambda i: "127.0.0.1", args, args.timeout))
    print(f"lab: computing {in_lab['compute']:.1%} of the time (goal >= 95%); outer held-out loss "
          f"{in_lab['loss'] / loopback['loss']:.3f}x the loopback run's (goal within 1.05x)", flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
