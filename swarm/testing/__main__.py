"""`python -m swarm.testing SCENARIO.toml [--out DIR]`: runs a lab scenario with a live view and
writes DIR/report.json and DIR/timeline.png (see docs/network-lab.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from swarm.testing.netns import LabError, clean_stale, missing_requirements
from swarm.testing.report import write
from swarm.testing.runner import Run
from swarm.testing.scenario import ScenarioError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.testing", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="?", help="scenario TOML file")
    parser.add_argument("--out", type=Path, default=None, help="report directory (default lab-out/NAME)")
    parser.add_argument("--quiet", action="store_true", help="no live view")
    parser.add_argument("--clean", action="store_true", help="only remove what killed labs left behind")
    args = parser.parse_args(argv)
    if args.clean:
        reason = missing_requirements()
        if reason:
            print(f"swarm lab: {reason}", file=sys.stderr)
            return 2
        print("\n".join(clean_stale()) or "nothing to clean")
        return 0
    if not args.scenario:
        parser.error("give a scenario file (or --clean)")
    try:
        scenario = load(args.scenario)
    except (OSError, ScenarioError) as e:
        print(f"swarm lab: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("lab-out") / scenario.name
    run = Run(scenario, out, live=not args.quiet)
    try:
        events = run.run()
    except LabError as e:
        print(f"swarm lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swarm lab: interrupted; the lab is removed", file=sys.stderr)
        events = run.events
    json_path, png = write(events, out, scenario.name, run.relay)
    figures = json.loads(json_path.read_text())["figures"]
    print(f"report {json_path}" + (f", timeline {png}" if png else " (no PNG: install the `lab` extra)"))
    print(json.dumps({k: figures[k] for k in ("collective_steps", "samples", "longest_stall_s", "median_step_s")}))
    for crash in figures["crashes"]:
        print(f"swarm lab: {crash['proc']} exited with status {crash['code']}", file=sys.stderr)
    return 1 if figures["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
