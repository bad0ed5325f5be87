#!/usr/bin/env python
"""Benchmark: what checkpointing costs a trainer, and a cold start from a checkpoint.

One process, one lone peer on loopback (a lone trainer takes its collective steps at once, so the
figures are the checkpoint's, not the network's), `swarm.Optimizer` over an MLP of ``--params``
parameters with Adam (so the state is three times the parameters).

0. Each save's cost to a trainer that keeps every core busy, measured per save: the stall (the
   snapshot the training thread waits for) and the writer thread's CPU time (``thread_time``:
   CPU a busy machine takes from training), ``--saves`` saves with direct I/O and as many through
   the page cache (the baseline), and their sum as a share of one save every ``--derive-at``
   seconds (derived: per-save cost / interval). Robust on a loaded machine, unlike phase 1.
1. Samples/s without checkpoints, then with one every ``--interval`` seconds, then without again
   (the baseline on both sides), ``--duration`` seconds each. Printed: the stall (the snapshot the
   training thread waits for, timed alone), each checkpoint's whole cost in trainer seconds (the
   samples the checkpointed phase lost against the baseline's mean rate, divided by its
   checkpoints: the stall plus the writer thread's competition for the cores), and that cost as a
   share of samples/s at one checkpoint every ``--derive-at`` seconds (300: five minutes), derived
   from the per-checkpoint cost because a phase of several 5-minute intervals is too long here.
2. A checkpoint of ``--cold-gb`` GB (parameters plus Adam's moments) on disk, its pages dropped
   from the page cache (``posix_fadvise(DONTNEED)`` on its files only); then the time from a new
   peer's start to its first collective step resumed from it, against reading the same bytes
   from disk after dropping them again.

    .venv/bin/python scripts/bench/bench_checkpoint.py [--params 100e6] [--saves 3] [--duration 60]
        [--interval 15] [--cold-gb 1.0] [--dir /var/tmp/bench-ckpt] [--page-cache]
        [--skip-save-cpu] [--skip-cost] [--skip-cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch

from swarm.checkpoint import format as checkpoint_format
from swarm.optim import CollaborationConfig, Optimizer
from swarm.optim.checkpointing import CheckpointConfig
from swarm.peer import Peer

BATCH = 16


def make_model(params: float, width: int = 2048) -> torch.nn.Module:
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def make_optimizer(peer: Peer, model: torch.nn.Module, checkpoint: CheckpointConfig | None,
                   resume_from: Path | None = None, run_id: str = "bench-ckpt") -> Optimizer:
    return Optimizer(peer, run_id=run_id, params=model.parameters(),
                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), batch_size_per_step=BATCH,
                     config=CollaborationConfig(target_batch_size=BATCH, report_period=1.0),
                     checkpoint=checkpoint, resume_from=resume_from)


def train(opt: Optimizer, model: torch.nn.Module, seconds: float) -> float:
    """Trains for `seconds`; returns samples per second."""
    x = torch.randn(BATCH, model[0].in_features)
    samples, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        samples += BATCH
    return samples / (time.monotonic() - started)


def drop_cache(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_cost(args: argparse.Namespace, work: Path) -> None:
    model = make_model(args.params)
    count = sum(p.numel() for p in model.parameters())
    state_gb = count * 12 / 1e9
    # each phase a peer and a run of its own: no record of the phase before makes it wait for a group
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        plain = make_optimizer(peer, model, None, run_id="before")
        train(plain, model, min(5.0, args.duration))  # warm up: Adam's state exists, allocations settle
        before = train(plain, model, args.duration)
        plain.shutdown()
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        config = CheckpointConfig(work / "cost", every_epochs=None, every_seconds=args.interval, keep=2)
        opt = make_optimizer(peer, model, config, run_id="checkpointed")
        train(opt, model, 0.1)  # Adam's state exists before the phase (its first step makes it)
        assert opt.checkpointer is not None
        stalls = []
        for _ in range(3):  # what the training thread waits for at each save: the snapshot
            started = time.monotonic()
            opt._snapshot()
            stalls.append(time.monotonic() - started)
        opt.checkpointer.resumed_at(opt.epoch)  # the schedule starts with the phase
        phase_started = time.monotonic()
        with_checkpoints = train(opt, model, args.duration)
        phase = time.monotonic() - phase_started
        opt.checkpointer.wait()
        saves, failures = opt.checkpointer.saves, opt.checkpointer.failures
        writer_cpu = list(opt.checkpointer.writer_cpu_seconds)
        opt.shutdown()
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        plain = make_optimizer(peer, model, None, run_id="after")
        train(plain, model, 0.1)
        after = train(plain, model, args.duration)
        plain.shutdown()
    baseline = (before + after) / 2
    lost = phase * (1 - with_checkpoints / baseline)  # trainer seconds the checkpoints took
    per_checkpoint = lost / max(saves, 1)
    print(f"model: {count / 1e6:.0f}M parameters, state with Adam {state_gb:.2f} GB; baseline {before:.1f} / "
          f"{after:.1f} samples/s before / after", flush=True)
    print(f"checkpoint stall (snapshot the trainer waits for): {statistics.median(stalls):.2f} s median of 3",
          flush=True)
    print(f"samples/s with a checkpoint every {args.interval:.0f} s: {with_checkpoints:.1f} vs baseline {baseline:.1f} "
          f"({100 * (1 - with_checkpoints / baseline):+.1f}% cost, {saves} saves, {failures} failed)", flush=True)
    print(f"cost per checkpoint: {per_checkpoint:.2f} trainer-seconds; at one every {args.derive_at:.0f} s: "
          f"{100 * per_checkpoint / args.derive_at:.2f}% of samples/s (derived; goal <= 2%)", flush=True)
    cpu = statistics.median(writer_cpu) if writer_cpu else float("nan")
    stall = statistics.median(stalls)
    print(f"writer CPU per checkpoint ({'direct I/O' if checkpoint_format.DIRECT_IO else 'page cache'}): {cpu:.2f} s median "
          f"of {len(writer_cpu)}; stall + writer CPU at one every {args.derive_at:.0f} s: "
          f"{100 * (stall + cpu) / args.derive_at:.2f}% of a trainer using every core", flush=True)


def bench_save_cpu(args: argparse.Namespace, work: Path) -> None:
    """What each save takes from a trainer that keeps every core busy: the stall (the snapshot it
    waits for) plus the CPU time of the writer thread (which a busy machine takes from training),
    with direct I/O and through the page cache, in one invocation."""
    model = make_model(args.params)
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        opt = make_optimizer(peer, model, CheckpointConfig(work / "cpu", every_epochs=None, every_seconds=1e9, keep=1),
                             run_id="cpu")
        train(opt, model, 0.1)  # Adam's state exists
        checkpointer = opt.checkpointer
        assert checkpointer is not None
        for direct in (True, False):
            checkpoint_format.DIRECT_IO = direct
            stalls, walls = [], []
            checkpointer.writer_cpu_seconds.clear()
            for i in range(args.saves):
                shutil.rmtree(work / "cpu", ignore_errors=True)
                started = time.monotonic()
                snapshot = opt._snapshot()
                stalls.append(time.monotonic() - started)
                snapshot.epoch = 1000 + i
                written = time.monotonic()
                checkpointer.save(snapshot, 0, wait=True)
                walls.append(time.monotonic() - written)
            cpu, stall = statistics.median(checkpointer.writer_cpu_seconds), statistics.median(stalls)
            print(f"save ({'direct I/O' if direct else 'page cache'}): stall {stall:.2f} s, writer CPU {cpu:.2f} s, "
                  f"write {statistics.median(walls):.2f} s (medians of {args.saves}); stall + writer CPU at one "
                  f"every {args.derive_at:.0f} s: {100 * (stall + cpu) / args.derive_at:.2f}% of a trainer using "
                  f"every core (derived)", flush=True)
        opt.shutdown()
    checkpoint_format.DIRECT_IO = not args.page_cache


def bench_cold_start(args: argparse.Namespace, work: Path) -> None:
    params = args.cold_gb * 1e9 / 12  # parameters plus Adam's two moments, float32
    model = make_model(params)
    directory = work / "cold"
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        opt = make_optimizer(peer, model, CheckpointConfig(directory, every_epochs=1, keep=1))
        train(opt, model, 0.1)  # one collective step, saved
        assert opt.checkpointer is not None and opt.checkpointer.wait()
        opt.shutdown()
    epoch_saved = max(int(p.name.split("-")[1]) for p in directory.iterdir() if p.name.startswith("epoch-"))
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    del model, opt
    fresh = make_model(params)
    drop_cache(directory)
    started = time.monotonic()
    with Peer(listen="/ip4/127.0.0.1/tcp/0") as peer:
        peer_started = time.monotonic()
        opt = make_optimizer(peer, fresh, None, resume_from=directory)
        resumed = time.monotonic()
        assert opt.epoch == epoch_saved, (opt.epoch, epoch_saved)
        x = torch.randn(BATCH, fresh[0].in_features)
        while opt.epoch == epoch_saved:
            fresh(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        first_step = time.monotonic()
        opt.shutdown()
    tensors = next(directory.rglob("tensors.safetensors"))
    drop_cache(tensors)
    read_started = time.monotonic()
    with open(tensors, "rb") as f:
        while f.read(16 << 20):
            pass
    read = time.monotonic() - read_started
    total = first_step - started
    print(f"cold start from a {size / 1e9:.2f} GB checkpoint: {total:.2f} s to the first collective step "
          f"(peer {peer_started - started:.2f} s, resume {resumed - peer_started:.2f} s, first step "
          f"{first_step - resumed:.2f} s); reading {tensors.stat().st_size / 1e9:.2f} GB from disk: {read:.2f} s; "
          f"ratio {total / read:.1f}x (resume alone {(resumed - peer_started) / read:.1f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the cost benchmark's model")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between checkpoints in the phase")
    parser.add_argument("--derive-at", type=float, default=300.0, help="the interval the cost is derived for")
    parser.add_argument("--cold-gb", type=float, default=1.0, help="size of the cold start's checkpoint")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temporary dir)")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--page-cache", action="store_true", help="write through the page cache, not direct I/O")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode in the save-CPU measurement")
    parser.add_argument("--skip-save-cpu", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    checkpoint_format.DIRECT_IO = not args.page_cache
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        if not args.skip_save_cpu:
            bench_save_cpu(args, work)
        if not args.skip_cost:
            bench_cost(args, work)
        if not args.skip_cold:
            bench_cold_start(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
