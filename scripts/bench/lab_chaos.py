#!/usr/bin/env python
"""Scenario 2 of the network lab: chaos. Runs swarm/testing/scenarios/chaos.toml (the WAN demo's
hosts; for 5 minutes one random fault every 20 s: a trainer killed and restarted, the expert
server stopped for 10 s, a trainer partitioned for 15 s, a newcomer joining) and checks the
pass criteria it can check from outside the processes:

  * training never stalls longer than 3 collective-step times (after the first step);
  * no process and no namespace is left behind;
  * nothing a user would see as a crash: no exit with an error the scenario did not cause, no
    Python traceback in any process's log.

    .venv/bin/python scripts/bench/lab_chaos.py [--out lab-out/chaos] [--scenario FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("lab-out/chaos"))
    parser.add_argument("--scenario", type=Path, default=Path(ROOT) / "swarm/testing/scenarios/chaos.toml")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    from swarm.testing import report
    from swarm.testing.netns import lab_namespaces
    from swarm.testing.runner import Run
    from swarm.testing.scenario import load

    scenario = load(args.scenario)
    run = Run(scenario, args.out, live=not args.quiet)
    events = run.run()
    report.write(events, args.out, scenario.name, run.relay)
    f = report.figures(events, run.relay)
    prefix = events[0]["prefix"]
    left = lab_namespaces(prefix)
    tracebacks = [p.name for p in (args.out / "logs").glob("*.log") if "Traceback" in p.read_text(errors="replace")]
    stall, step = f["longest_stall_s"], f["median_step_s"]
    checks = {
        f"longest stall {stall:.1f} s <= 3 x median step {step:.1f} s": not math.isnan(stall) and stall <= 3 * step,
        f"namespaces left: {left or 'none'}": not left,
        f"crashes: {[c['proc'] for c in f['crashes']] or 'none'}": not f["crashes"],
        f"tracebacks in logs: {tracebacks or 'none'}": not tracebacks,
    }
    faults = f["faults"]
    print(f"lab chaos: {len(faults)} faults over {f['seconds']:.0f} s; {f['collective_steps']} collective steps, "
          f"{f['samples']} samples; report in {args.out}")
    for what, ok in checks.items():
        print(f"  {'pass' if ok else 'FAIL'}  {what}")
    print("  not checked: bit-identical shared parameters after the last heal (the demo trainer prints no digest)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
