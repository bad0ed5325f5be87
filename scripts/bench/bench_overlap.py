#!/usr/bin/env python
"""Benchmark: swarm's trainers against one plain process, with and without rounds overlapping compute.

In one invocation, on the demo's byte-level LM (`swarm.demo.model`, mixture held locally) and the
same data, each phase `--seconds` of wall time:

1. one plain PyTorch process alone on the machine with all threads (the issue's setup: one 2-thread
   process on this box; `--plain-threads 1 2` runs both and the faster counts), then any
   `--plain-references BATCH:LR` (e.g. the batch of all trainers together: the loss that
   data-parallel training at the trainers' step rate can reach in the same wall time);
   and any `--ddp-references LR[:WARMUP]`: `--peers` processes x 1 thread of synchronous
   data-parallel training with torch.distributed (gloo), batch 16 each, one all-reduce a step (the
   loss the trainers could reach on these CPUs if coordinating cost nothing beyond gloo's
   all-reduce: the bound to read the trainers' figures against);
2. `--peers` swarm trainers x 1 torch thread in large-batch mode, every round waited for
   (`max_staleness=0`);
3. the same trainers with each round averaging while they compute the next batches
   (`max_staleness=1`, the default);
4. with `--plain-again`, the plain baseline once more, after everything else: each phase is then
   also counted against the mean of the two plain runs, so a drift of the machine's speed over the
   invocation (other load coming or going) does not fall on one side of the comparison only;
   with `--plain-between`, the plain baseline after every phase instead, each phase counted against
   the mean of the plain runs just before and just after it (the plain process alone moved by up to
   9% between two runs of one invocation: a drift over ten minutes falls on both sides of each phase).
   Either way each such line ends with whether the phase met the overlap goals against that baseline
   (`SPEED_GOAL`: >= 0.9x the samples/s, `LOSS_GOAL`: <= 1.05x the held-out loss).

For each swarm phase: samples/s of all trainers over the plain process's, held-out loss over the
plain process's, the share of a trainer's time in compute (forward, backward), in `step()` and
waiting for its group, and where each trainer process's CPU went, by thread (the training thread,
the peer's loop, executor threads, native gRPC/OpenMP threads).

    .venv/bin/python scripts/bench/bench_overlap.py [--seconds 60] [--peers 4] [--target-batch 512]
        [--variants TARGET:LR[:WARMUP[:STALENESS[:TRIAL[:NEAR[:WIRE]]]]] | diloco:H[:BITS[:OUTER_LR[:MOMENTUM[:INNER_LR]]]] ...]
        [--plain-references BATCH:LR ...] [--ddp-references LR[:WARMUP] ...] [--hidden-dim 128]
        [--plain-again | --plain-between]

`--hidden-dim` sets the model's width in every phase: 128 is the demo's model (0.73M parameters),
480 gives 9.5M, about the size of the model the issue's comparison names (~9.8M).

`--variants` adds overlapped phases with another target batch, learning rate or warm-up, side by
side with the default ones in the same invocation (what the held-out loss gap comes from; TRIAL 0
turns off `CollaborationConfig.trial_step`, so overlapped trainers compute at the parameters they
hold; NEAR sets, for rounds waited for, the share of a batch's time within which a trainer waits for
a near target, `swarm.optim.optimizer.NEAR_TARGET`, 0 to never wait; WIRE names the gradients'
codec on the wire, a `swarm.compression.CompressionType`, e.g. FLOAT16, the library's default unless given);
`diloco:H[:BITS[:OUTER_LR[:MOMENTUM[:INNER_LR]]]]` adds a DiLoCo phase: H inner steps of the plain
process's batch per round, 8-bit (4-bit; 32: uncompressed) pseudo-gradients, outer SGD with that
learning rate and Nesterov momentum (0.7, 0.9; momentum 0: plain SGD), inner Adam at the plain
process's learning rate unless INNER_LR says otherwise, rounds overlapped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).parent
# the overlap goals for a phase against the plain process: at least this share of its samples/s,
# at most this multiple of its held-out loss after the same wall time
SPEED_GOAL, LOSS_GOAL = 0.9, 1.05
_spec = importlib.util.spec_from_file_location("bench_training", HERE / "bench_training.py")
assert _spec is not None and _spec.loader is not None
bench_training = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_training)


def describe(name: str, results: list[dict[str, Any]], plain: dict[str, Any]) -> tuple[float, float]:
    """Prints a phase's figures against the plain baseline; returns its (samples/s of all trainers,
    mean held-out loss)."""
    total = sum(r["samples_per_s"] for r in results)
    loss = statistics.mean(r["final_loss"] for r in results)
    compute = statistics.mean(r["compute_s"] / r["elapsed"] for r in results)
    idle = statistics.mean(r["idle_s"] / r["elapsed"] for r in results)
    step = statistics.mean(r["step_s"] / r["elapsed"] for r in results)
    cpu: dict[str, float] = {}
    for r in results:
        for thread, seconds in r["cpu"].items():
            cpu[thread] = cpu.get(thread, 0.0) + seconds / len(results)
    cpu_total = sum(cpu.values()) or 1.0
    # samples per CPU-second, all trainers' CPU counted: the machine's other load does not enter it
    per_cpu = sum(r["samples"] for r in results) / (cpu_total * len(results))
    plain_per_cpu = plain["samples"] / plain["cpu_s"]
    shares = ", ".join(f"{thread} {seconds / cpu_total:.0%}" for thread, seconds in
                       sorted(cpu.items(), key=lambda kv: -kv[1]) if seconds / cpu_total >= 0.005)
    print(f"{name}: {total:.1f} samples/s in all = {total / plain['samples_per_s']:.2f}x the plain process; "
          f"held-out loss {loss:.3f} = {loss / plain['loss']:.3f}x; {results[0]['epochs']} collective steps, "
          f"staleness {sorted({s for r in results for s in r['staleness']})}, failed rounds "
          f"{sum(r['failed_rounds'] for r in results)}, state downloads {sum(r.get('state_loads', 0) for r in results)}, "
          f"caught up from a round's result {sum(r.get('catch_ups', 0) for r in results)}",
          flush=True)
    print(f"  {per_cpu:.1f} samples per CPU-second = {per_cpu / plain_per_cpu:.2f}x the plain process's "
          f"{plain_per_cpu:.1f}", flush=True)
    print(f"  per trainer: {compute:.0%} of wall time in compute, {step:.1%} in step() "
          f"({idle:.1%} waiting for its group); CPU {cpu_total:.1f} s per process: {shares}", flush=True)
    if all("gc_full" in r for r in results):  # bench_training's FullCollections
        print(f"  full garbage collections per trainer: {statistics.mean(r['gc_full'][0] for r in results):.1f}, "
              f"longest {max(r['gc_full'][1] for r in results):.3f} s, "
              f"{statistics.mean(r['gc_full'][2] for r in results):.2f} s in all; objects frozen out of them "
              f"{min(r['gc_full'][3] for r in results)}", flush=True)
    rpcs: dict[str, float] = {}
    for r in results:
        for method, count in r.get("rpcs", {}).items():
            rpcs[method] = rpcs.get(method, 0.0) + count / len(results) / r["elapsed"]
    top = sorted(rpcs.items(), key=lambda kv: -kv[1])[:8]
    print("  RPCs per trainer per second (in: served, out: made): "
          + ", ".join(f"{method} {rate:.1f}" for method, rate in top), flush=True)
    return total, loss


class Phase(NamedTuple):
    """One swarm phase: large-batch (target > 0) or DiLoCo (target 0: `warmup` is H, `lr` the inner
    learning rate, 0 for the plain process's)."""

    target: int
    lr: float
    warmup: int = 0
    staleness: int = 1
    bits: int = 32  # DiLoCo's pseudo-gradients
    outer_lr: float = 0.0
    momentum: float = 0.0
    trial: bool = True
    near: float | None = None  # `NEAR_TARGET` for this phase; None: the library's
    wire: str | None = None  # the gradients' codec on the wire; None: the library's default

    def name(self, default_lr: float) -> str:
        if self.target == 0:
            return (f"DiLoCo H={self.warmup} ({self.bits}-bit, overlapped), inner lr {self.lr or default_lr}, "
                    f"outer lr {self.outer_lr}, momentum {self.momentum}")
        return (f"max_staleness={self.staleness}, target {self.target}, lr {self.lr}, warm-up {self.warmup}"
                + ("" if self.trial or not self.staleness else ", no trial step")
                + ("" if self.near is None else f", near target {self.near}")
                + ("" if self.wire is None else f", gradients as {self.wire}"))


def parse_variant(text: str) -> Phase:
    """`TARGET:LR[:WARMUP[:STALENESS[:TRIAL[:NEAR[:WIRE]]]]]`: target batch, Adam's learning rate, collective steps
    of linear warm-up, max_staleness (1: rounds overlapped, the default; 0: each step waits for its round),
    trial_step (1, the default; 0: off), and with rounds waited for, the share of its next batch's time
    within which a trainer waits for a near target (`swarm.optim.optimizer.NEAR_TARGET`; 0: never; the
    library's value unless given; empty: that value), and the gradients' codec on the wire
    (`CompressionType`'s name; the library's default unless given);
    or `diloco:H[:BITS[:OUTER_LR[:MOMENTUM[:INNER_LR]]]]`: DiLoCo with H inner steps per round, 8-bit
    (4-bit, 32: none) pseudo-gradients, outer SGD learning rate (0.7) and Nesterov momentum (0.9; 0:
    plain SGD), inner learning rate (0: the plain process's)."""
    from swarm.compression import CompressionType

    parts = text.split(":")
    try:
        if parts[0] == "diloco" and 2 <= len(parts) <= 6 and (len(parts) == 2 or parts[2] in ("4", "8", "32")):
            bits = int(parts[2]) if len(parts) >= 3 else 8
            outer_lr = float(parts[3]) if len(parts) >= 4 else 0.7
            momentum = float(parts[4]) if len(parts) >= 5 else 0.9
            inner_lr = float(parts[5]) if len(parts) == 6 else 0.0
            if outer_lr > 0 and 0 <= momentum < 1 and inner_lr >= 0:
                return Phase(0, inner_lr, int(parts[1]), bits=bits, outer_lr=outer_lr, momentum=momentum, trial=False)
        elif 2 <= len(parts) <= 7 and all(flag in ("0", "1") for flag in parts[3:5]):
            near = float(parts[5]) if len(parts) >= 6 and parts[5] else None
            wire = parts[6] if len(parts) == 7 else None
            if (near is None or near >= 0) and (wire is None or wire in CompressionType.__members__):
                return Phase(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) >= 3 else 0,
                             int(parts[3]) if len(parts) >= 4 else 1, trial=len(parts) < 5 or parts[4] == "1",
                             near=near, wire=wire)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"a variant is TARGET:LR[:WARMUP[:STALENESS[:TRIAL[:NEAR[:WIRE]]]]] or diloco:H[:BITS[:OUTER_LR[:MOMENTUM[:INNER_LR]]]], got {text!r}")


def bracketed(phases: dict[str, tuple[float, float, int]],
              plains: list[tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Each phase's samples/s and held-out loss over the mean of the plain runs just before and just
    after it: `phases` maps a name to (samples/s, loss, the index in `plains` of the run before it),
    `plains` holds the plain runs' (samples/s, loss) in the order they ran."""
    ratios = {}
    for name, (speed, loss, before) in phases.items():
        pair = plains[before:before + 2]
        ratios[name] = (speed / statistics.mean(s for s, _ in pair), loss / statistics.mean(lo for _, lo in pair))
    return ratios


def verdict(speed_ratio: float, loss_ratio: float) -> str:
    """Whether a phase met the issue's goals (`SPEED_GOAL`, `LOSS_GOAL`), judged on the unrounded
    ratios (a miss says its ratio to four places, where the line's rounding would hide it)."""
    missed = ([f"samples/s {speed_ratio:.4f}x < {SPEED_GOAL}x"] if speed_ratio < SPEED_GOAL else []) + (
        [f"held-out loss {loss_ratio:.4f}x > {LOSS_GOAL}x"] if loss_ratio > LOSS_GOAL else [])
    return "both goals met" if not missed else f"goal missed: {'; '.join(missed)}"


def parse_plain(text: str) -> tuple[int, float]:
    """`BATCH:LR`: one more plain process (the baseline's threads) with this batch and Adam learning rate."""
    try:
        batch, lr = text.split(":")
        return int(batch), float(lr)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a plain reference is BATCH:LR, got {text!r}") from None


def parse_ddp(text: str) -> tuple[float, int]:
    """`LR[:WARMUP]`: a torch.distributed data-parallel phase with this Adam learning rate and warm-up."""
    try:
        lr, _, warmup = text.partition(":")
        return float(lr), int(warmup or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a ddp reference is LR[:WARMUP], got {text!r}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (the plain process's too)")
    parser.add_argument("--skip-sync", action="store_true", help="leave out the max_staleness=0 phase")
    parser.add_argument("--variants", nargs="*", type=parse_variant, default=[],
                        help="more phases, each TARGET:LR[:WARMUP[:STALENESS[:TRIAL[:NEAR[:WIRE]]]]] (target batch, learning rate, "
                             "collective steps of linear warm-up), run after the default ones in the same "
                             "invocation, e.g. 512:0.017:3 (the learning rate scaled by sqrt(512/16))")
    parser.add_argument("--plain-threads", type=int, nargs="*", default=None,
                        help="thread counts of the plain process (default: all cores, the issue's one 2-thread "
                             "process on this box; with several, the faster counts)")
    parser.add_argument("--plain-references", nargs="*", type=parse_plain, default=[],
                        help="more plain processes, each BATCH:LR, after the baseline (e.g. 64:0.006: one process "
                             "taking the steps of 4 trainers' combined batch, what data-parallel training can reach)")
    parser.add_argument("--ddp-references", nargs="*", type=parse_ddp, default=[],
                        help="synchronous data-parallel phases with torch.distributed (gloo), each LR[:WARMUP]: "
                             "--peers processes x 1 thread, batch 16 each, one all-reduce per step; the loss the "
                             "trainers could reach with no coordination cost beyond gloo's all-reduce")
    parser.add_argument("--skip-default", action="store_true",
                        help="run only the --variants phases (the plain baseline still runs first)")
    drift = parser.add_mutually_exclusive_group()
    drift.add_argument("--plain-again", action="store_true",
                        help="run the plain baseline once more after all the other phases and also count each phase "
                             "against the mean of the two plain runs (the machine's drift over the invocation cancels)")
    drift.add_argument("--plain-between", action="store_true",
                        help="run the plain baseline again after each phase and also count each phase against "
                             "the mean of the plain runs just before and just after it")
    parser.add_argument("--hidden-dim", type=int, default=128,
                        help="the model's width in every phase: 128 is the demo's (0.73M parameters), 480 gives "
                             "9.5M, about the size of the issue's comparison model (~9.8M)")
    args = parser.parse_args()
    seconds = str(args.seconds)

    def run(mode: str, peers: int, extra: list[str], timeout: float) -> list[dict[str, Any]]:
        return bench_training.run_workers(mode, peers, [*extra, "--hidden-dim", str(args.hidden_dim)], timeout)

    def run_plain(threads: int, lr: float, *extra: str) -> dict[str, Any]:
        return run("plain", 1, ["--max-seconds", seconds, "--threads", str(threads), "--lr", str(lr), *extra],
                   args.seconds + 120)[0]

    if args.hidden_dim != 128:
        print(f"model: hidden_dim {args.hidden_dim}", flush=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    plains = [(threads, run_plain(threads, args.lr)) for threads in (args.plain_threads or [os.cpu_count() or 1])]
    for threads, result in plains:
        print(f"one plain process, {threads} thread(s): {result['samples_per_s']:.1f} samples/s, held-out loss "
              f"{result['loss']:.3f} after {args.seconds} s, {result['steps']} steps (batch {bench_training.BATCH}, "
              f"lr {args.lr})", flush=True)
    threads, plain = max(plains, key=lambda tr: tr[1]["samples_per_s"])
    for batch, lr in args.plain_references:
        result = run_plain(threads, lr, "--batch", str(batch))
        print(f"plain reference, {threads} thread(s), batch {batch}, lr {lr}: {result['samples_per_s']:.1f} samples/s, "
              f"{result['steps']} steps, held-out loss {result['loss']:.3f} = {result['loss'] / plain['loss']:.3f}x "
              f"the baseline's ({plain['steps']} steps)", flush=True)
    figures: dict[str, tuple[float, float]] = {}  # each phase's samples/s and held-out loss
    plain_runs = [(plain["samples_per_s"], plain["loss"])]  # the baseline's runs in order (--plain-between)
    before: dict[str, int] = {}  # each phase's plain run just before it, an index into plain_runs

    def unique(name: str) -> str:
        """The phase's name, numbered when the same phase runs more than once in the invocation."""
        if name not in figures:
            return name
        runs = sum(n == name or n.startswith(name + " (#") for n in figures)
        return f"{name} (#{runs + 1})"

    def after_phase(name: str) -> None:
        before[name] = len(plain_runs) - 1
        if args.plain_between:
            again = run_plain(threads, args.lr)
            plain_runs.append((again["samples_per_s"], again["loss"]))
            print(f"the plain process again, {threads} thread(s): {again['samples_per_s']:.1f} samples/s, held-out "
                  f"loss {again['loss']:.3f}, {again['steps']} steps", flush=True)

    for lr, warmup in args.ddp_references:
        results = run("ddp", args.peers, [
            "--max-seconds", seconds, "--threads", "1", "--lr", str(lr), "--warmup-steps", str(warmup),
            "--ddp-port", str(free_port())], args.seconds + 120)
        name = unique(f"{args.peers} torch.distributed (gloo) ranks, synchronous, batch {bench_training.BATCH} "
                      f"each, lr {lr}, warm-up {warmup}")
        figures[name] = describe(name, results, plain)
        after_phase(name)
    phases = [] if args.skip_default else [Phase(args.target_batch, args.lr, staleness=staleness)
                                           for staleness in ([1] if args.skip_sync else [0, 1])]
    for phase in [*phases, *args.variants]:
        if phase.target == 0:  # DiLoCo: inner Adam steps of the plain process's batch and learning rate
            codec = "NONE" if phase.bits == 32 else f"UNIFORM_{phase.bits}BIT"
            extra = ["--max-seconds", seconds, "--threads", "1", "--lr", str(phase.lr or args.lr),
                     "--local-steps", str(phase.warmup), "--target-loss", "0", "--max-staleness", "1",
                     "--compression", codec, "--outer-lr", str(phase.outer_lr), "--outer-momentum", str(phase.momentum)]
            results = run("diloco", args.peers, extra, args.seconds + 180)
        else:
            extra = ["--max-seconds", seconds, "--threads", "1", "--target-batch-size", str(phase.target),
                     "--lr", str(phase.lr), "--warmup-steps", str(phase.warmup), "--max-staleness", str(phase.staleness),
                     *([] if phase.trial else ["--no-trial-step"]),
                     *([] if phase.near is None else ["--near-target", str(phase.near)]),
                     *([] if phase.wire is None else ["--gradient-compression", phase.wire])]
            results = run("swarm", args.peers, extra, args.seconds + 180)
        name = unique(f"{args.peers} trainers, {phase.name(args.lr)}")
        figures[name] = describe(name, results, plain)
        after_phase(name)
    if args.plain_between:
        speeds = [speed for speed, _ in plain_runs]
        print(f"the plain process's {len(speeds)} runs: {', '.join(f'{s:.1f}' for s in speeds)} samples/s "
              f"(spread {max(speeds) / min(speeds) - 1:.1%})", flush=True)
        ratios = bracketed({name: (*figures[name], before[name]) for name in figures}, plain_runs)
        for name, (speed_ratio, loss_ratio) in ratios.items():
            print(f"  against the plain runs either side: {name}: {speed_ratio:.2f}x the samples/s, "
                  f"{loss_ratio:.3f}x the held-out loss ({verdict(speed_ratio, loss_ratio)})", flush=True)
    elif args.plain_again:
        again = run_plain(threads, args.lr)
        speed = (plain["samples_per_s"] + again["samples_per_s"]) / 2
        loss = (plain["loss"] + again["loss"]) / 2
        print(f"the plain process again, {threads} thread(s), after every other phase: {again['samples_per_s']:.1f} "
              f"samples/s, held-out loss {again['loss']:.3f}, {again['steps']} steps; the mean of the two runs: "
              f"{speed:.1f} samples/s, held-out loss {loss:.3f}", flush=True)
        for name, (total, phase_loss) in figures.items():
            print(f"  against that mean: {name}: {total / speed:.2f}x the samples/s, {phase_loss / loss:.3f}x the "
                  f"held-out loss, {verdict(total / speed, phase_loss / loss)} (against the run after alone: {total / again['samples_per_s']:.2f}x, "
                  f"{phase_loss / again['loss']:.3f}x)", flush=True)
    print(f"baseline: the plain process with {threads} thread(s); load average after: {os.getloadavg()}",
          flush=True)


if __name__ == "__main__":
    main()
