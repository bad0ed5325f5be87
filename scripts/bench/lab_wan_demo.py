#!/usr/bin/env python
"""Scenario 1 of the network lab: the demo's swarm over a WAN against the same swarm on unshaped
links, in one invocation. Runs swarm/testing/scenarios/wan-demo-lan.toml then wan-demo.toml
(one expert server, three trainers, one trainer behind NAT in client mode; 50 ms RTT, 100 Mbit/s
and 0.5% loss between any two hosts in the second) and compares the held-out loss after the same
number of collective steps (goal: within 10%), samples/s and bytes sent.

    .venv/bin/python scripts/bench/lab_wan_demo.py [--out lab-out]

Each run's report (report.json, timeline.png) lands in OUT/wan-demo-lan and OUT/wan-demo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SCENARIOS = Path(ROOT) / "swarm" / "testing" / "scenarios"


def held_out_by_epoch(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(collective steps the trainer had seen, held-out loss) for every evaluation."""
    epoch: dict[str, int] = {}
    points = []
    for e in events:
        if e["kind"] == "progress":
            epoch[e["proc"]] = int(e["epoch"])
        elif e["kind"] == "eval" and e["proc"] in epoch:
            points.append((epoch[e["proc"]], float(e["loss"])))
    return points


def loss_at(points: list[tuple[int, float]], steps: int) -> float:
    """Mean held-out loss of the evaluations made at the last epoch <= `steps` that has any."""
    eligible = [e for e, _ in points if e <= steps]
    if not eligible:
        return float("nan")
    best = max(eligible)
    return statistics.fmean(v for e, v in points if e == best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("lab-out"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    from swarm.testing import report
    from swarm.testing.runner import Run
    from swarm.testing.scenario import load

    results = {}
    for name in ("wan-demo-lan", "wan-demo"):
        scenario = load(SCENARIOS / f"{name}.toml")
        run = Run(scenario, args.out / name, live=not args.quiet)
        events = run.run()
        report.write(events, args.out / name, name, run.relay)
        results[name] = (events, report.figures(events, run.relay))
    steps = min(int(f["collective_steps"]) for _, f in results.values())
    print(f"lab WAN demo: held-out loss after {steps} collective steps; trainers' samples/s (median); bytes sent")
    losses = {}
    for name, (events, f) in results.items():
        losses[name] = loss_at(held_out_by_epoch(events), steps)
        rates = [t.get("samples_per_second_median", 0) for t in f["trainers"].values()]
        avg_bytes = sum(t.get("averaging_bytes", 0) for t in f["trainers"].values())
        exp_bytes = sum(t.get("expert_bytes", 0) for t in f["trainers"].values())
        relay = f["relay"]
        print(f"  {name:<13} held-out {losses[name]:.3f} at {steps} steps (reached {f['collective_steps']} in "
              f"{f['seconds']:.0f} s, median step {f['median_step_s']:.1f} s, longest stall {f['longest_stall_s']:.1f} s);"
              f" {sum(rates):.1f} samples/s over {len(rates)} trainers; averaging {avg_bytes / 1e6:.0f} MB, experts "
              f"{exp_bytes / 1e6:.0f} MB" + (f"; relay CPU {relay['cpu_seconds']:.0f} s over {relay['wall_seconds']:.0f} s"
                                          if relay else "") + f"; crashes {len(f['crashes'])}", flush=True)
    lan, wan = losses["wan-demo-lan"], losses["wan-demo"]
    print(f"  WAN / LAN held-out loss at {steps} steps: {wan / lan:.3f} (goal within 10%: "
          f"{'met' if abs(wan / lan - 1) <= 0.10 else 'NOT met'})")


if __name__ == "__main__":
    main()
