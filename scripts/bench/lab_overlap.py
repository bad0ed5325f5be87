#!/usr/bin/env python
"""Network lab: training with communication overlapped with compute, across a wide-area link.

`--peers` trainers of the demo's byte-level LM (`scripts/bench/bench_training.py`'s worker, mixture
held locally, 1 torch thread each), each on its own lab host with a `--mbit` link each way and
`--delay-ms` one way (a 50 ms round trip between two hosts by default):

1. DiLoCo (H = `--local-steps`, 8-bit pseudo-gradients), every round waited for (max_staleness 0),
   `--steps` inner steps per trainer;
2. the same with each outer round averaging while the next inner steps compute (max_staleness 1),
   and with `--fragments` fragments synced in turn when given;
3. with `--compare-4bit`, overlapped DiLoCo again with 4-bit pseudo-gradients (UNIFORM_4BIT):
   its held-out loss and bytes over the 8-bit phase's;
4. large-batch mode (rounds overlapped) for `--seconds`, in the lab and then on loopback.

Figures: the share of each trainer's wall time in compute (not waiting for its group: the forward,
backward, inner optimizer steps and swarm's bookkeeping), until its last step (the last round,
which nothing can overlap, is shown apart), the held-out loss after the same number of inner steps (overlapped over waited), and
large-batch samples/s in the lab over loopback.

    .venv/bin/python scripts/bench/lab_overlap.py [--peers 4] [--steps 200] [--local-steps 50]
        [--gradient-wires SCALED_FLOAT16 NONE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_training", HERE / "bench_training.py")
assert _spec is not None and _spec.loader is not None
bench_training = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_training)


def run_in_lab(lab: Any, mode: str, peers: int, extra: list[str], timeout: float) -> list[dict[str, Any]]:
    """`bench_training.run_workers`, each worker on its own lab host (h0 first: the others bootstrap from it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    script = str(HERE / "bench_training.py")

    def argv(i: int) -> list[str]:
        return [sys.executable, script, "--worker", "--mode", mode, "--peers", str(peers), "--index", str(i),
                "--address", lab.address(f"h{i}"), *extra]

    procs = [lab.spawn("h0", argv(0), env=env)]
    try:
        addr = procs[0].stdout.readline().decode().strip()
        if not addr.startswith("/"):
            raise RuntimeError(f"worker 0 did not start ({procs[0].wait()})")
        procs += [lab.spawn(f"h{i}", [*argv(i), "--initial-peers", addr], env=env) for i in range(1, peers)]
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            lines = [line for line in out.decode().splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"a {mode} worker failed ({proc.returncode})")
            results.append(json.loads(lines[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def summary(name: str, results: list[dict[str, Any]]) -> dict[str, float]:
    compute = [r["compute_s"] / r["elapsed"] for r in results]
    # the share of wall time a trainer did not wait for its group, until its last step (the final
    # flush waits for the last round, which no later compute could overlap: shown apart)
    busy = [1 - r["before_flush"]["idle_s"] / r["before_flush"]["elapsed"] for r in results]
    flush = statistics.mean(r["elapsed"] - r["before_flush"]["elapsed"] for r in results)
    idle = [r["idle_s"] / r["elapsed"] for r in results]
    loss = statistics.mean(r["final_loss"] for r in results)
    sps = sum(r["samples_per_s"] for r in results)
    rounds = results[0]["epochs"]
    print(f"{name}: computing (not waiting for its group) {min(busy):.1%}-{max(busy):.1%} of each trainer's wall "
          f"time until its last step, then {flush:.2f} s for the last round; forward+backward "
          f"{min(compute):.1%}-{max(compute):.1%}, waiting {statistics.mean(idle):.1%} in all; held-out loss {loss:.4f} after {results[0]['samples'] // 16} inner "
          f"steps, {rounds} rounds, {statistics.mean(r['bytes_sent'] for r in results) / 1e6:.2f} MB sent per "
          f"trainer; {sps:.1f} samples/s in all; staleness {sorted({s for r in results for s in r['staleness']})}; "
          f"failed rounds {sum(r['failed_rounds'] for r in results)}, state downloads "
          f"{sum(r.get('state_loads', 0) for r in results)}, caught up from a round's result "
          f"{sum(r.get('catch_ups', 0) for r in results)}; {statistics.mean(r['elapsed'] for r in results):.0f} s",
          flush=True)
    return {"compute": min(busy), "loss": loss, "sps": sps,
            "bytes": statistics.mean(r["bytes_sent"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="inner steps per trainer in the DiLoCo phases")
    parser.add_argument("--local-steps", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--fragments", type=int, default=0, help="also run overlapped DiLoCo with this many fragments")
    parser.add_argument("--seconds", type=int, default=60, help="wall time of the large-batch phases")
    parser.add_argument("--target-batch", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=None,
                        help="the large-batch phases' model width (480: the 9.5M-parameter model of the issue's "
                             "comparison; default: the demo's)")
    parser.add_argument("--lr", type=float, default=None, help="the large-batch phases' learning rate")
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=12.5)
    parser.add_argument("--skip", nargs="*", default=[], choices=["diloco", "large-batch"])
    parser.add_argument("--gradient-wires", nargs="*", default=[],
                        help="run the large-batch phases once per gradient wire codec given (CompressionType names, "
                             "e.g. SCALED_FLOAT16 NONE), in turn; default: once, at the library's default")
    parser.add_argument("--compare-4bit", action="store_true",
                        help="also run overlapped DiLoCo with 4-bit pseudo-gradients (UNIFORM_4BIT) against 8-bit")
    args = parser.parse_args()

    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=args.delay_ms)
    print(f"lab overlap: {args.peers} trainers, each host {args.mbit:g} Mbit/s each way, {4 * args.delay_ms:g} ms "
          f"round trip; load average {os.getloadavg()}", flush=True)
    timeout = 1800.0
    with Lab([HostSpec(f"h{i}", link) for i in range(args.peers)], seed=1) as lab:
        if "diloco" not in args.skip:
            common = ["--threads", "1", "--target-loss", "0", "--max-seconds", "1200", "--max-steps", str(args.steps),
                      "--local-steps", str(args.local_steps)]
            waited = summary(f"DiLoCo H={args.local_steps}, rounds waited for",
                             run_in_lab(lab, "diloco", args.peers, [*common, "--max-staleness", "0"], timeout))
            overlapped = summary(f"DiLoCo H={args.local_steps}, rounds overlapped",
                                 run_in_lab(lab, "diloco", args.peers, [*common, "--max-staleness", "1"], timeout))
            print(f"overlap: compute share {overlapped['compute']:.1%} (target >= 95%) vs {waited['compute']:.1%} "
                  f"waited; held-out loss {overlapped['loss'] / waited['loss']:.3f}x the waited-for rounds' after "
                  f"the same inner steps (target within 1.05x)", flush=True)
            if args.compare_4bit:
                low_bit = summary(f"DiLoCo H={args.local_steps}, rounds overlapped, 4-bit pseudo-gradients",
                                  run_in_lab(lab, "diloco", args.peers, [*common, "--max-staleness", "1",
                                                                         "--compression", "UNIFORM_4BIT"], timeout))
                print(f"4-bit: held-out loss {low_bit['loss'] / overlapped['loss']:.3f}x the 8-bit overlapped rounds' "
                      f"after the same inner steps, {low_bit['bytes'] / overlapped['bytes']:.2f}x the bytes",
                      flush=True)
            if args.fragments > 1:
                streamed = summary(f"DiLoCo H={args.local_steps}, {args.fragments} fragments, overlapped",
                                   run_in_lab(lab, "diloco", args.peers, [*common, "--max-staleness", "1",
                                                                          "--fragments", str(args.fragments)], timeout))
                print(f"fragments: held-out loss {streamed['loss'] / waited['loss']:.3f}x the waited-for rounds'",
                      flush=True)
        wires: list[str | None] = list(args.gradient_wires) or [None]
        in_lab: dict[str | None, dict[str, Any]] = {}
        commons = {wire: ["--threads", "1", "--max-seconds", str(args.seconds), "--target-batch-size",
                          str(args.target_batch), *([] if wire is None else ["--gradient-compression", wire]),
                          *([] if args.hidden_dim is None else ["--hidden-dim", str(args.hidden_dim)]),
                          *([] if args.lr is None else ["--lr", str(args.lr)])]
                   for wire in wires}
        if "large-batch" not in args.skip:
            for wire in wires:
                in_lab[wire] = summary(f"large-batch, rounds overlapped, lab{'' if wire is None else ', ' + wire}",
                                       run_in_lab(lab, "swarm", args.peers, commons[wire], timeout))
    if "large-batch" not in args.skip:
        for wire in wires:
            name = "" if wire is None else f", gradients as {wire}"
            loopback = summary(f"large-batch, rounds overlapped, loopback{name}",
                               bench_training.run_workers("swarm", args.peers, commons[wire], args.seconds + 180))
            print(f"large-batch{name}: {in_lab[wire]['sps']:.1f} samples/s in the lab vs {loopback['sps']:.1f} on "
                  f"loopback ({in_lab[wire]['sps'] / loopback['sps']:.2f}x)", flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
