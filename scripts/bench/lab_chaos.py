#!/usr/bin/env python
"""Scenario 2 of the network lab: chaos. Runs swarm/testing/scenarios/chaos.toml (the WAN demo's
hosts; for 5 minutes one random fault every 20 s: a trainer killed and restarted, the expert
server stopped for 10 s, a trainer partitioned for 15 s, a newcomer joining) and checks the
pass criteria it can check from outside the processes:

  * training never stalls longer than 3 collective-step times (after the first step);
  * no process and no namespace is left behind;
  * nothing a user would see as a crash: no exit with an error the scenario did not cause, no
    Python traceback in any process's log;
  * after the last heal every trainer reaches a common epoch, and every epoch reported by more
    than one trainer has one digest (sha256) of the shared parameters (`report.digest_agreement`);
  * expert parameters survive the expert server's SIGKILL and restart (the scenario's fixed
    fault, after its first periodic checkpoint): the experts' update counts in the checkpoint it
    writes at the end continue those of the checkpoint on disk when it was killed, and grew (a
    server that lost them would count from zero again, and could not catch up in the minute left).

    .venv/bin/python scripts/bench/lab_chaos.py [--out lab-out/chaos] [--scenario FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def read_checkpoints(directory: Path) -> dict[str, int]:
    """Expert uid -> optimizer updates, from the checkpoints in `directory` (written whole and renamed
    over the old one: a reader never sees half a file)."""
    import torch

    updates = {}
    for path in directory.glob("*.pt"):
        payload = torch.load(path, map_location="cpu", weights_only=True)
        updates[payload["uid"]] = int(payload["state"]["updates"])
    return updates


def watch_checkpoints(directory: Path, seen: list[tuple[float, dict[str, int]]], stop: threading.Event) -> None:
    """Records (monotonic time, updates per expert) each time a checkpoint file in `directory` changes."""
    stamps: dict[str, float] = {}
    while not stop.wait(0.5):
        current = {p.name: p.stat().st_mtime for p in directory.glob("*.pt")} if directory.is_dir() else {}
        if current and current != stamps:
            stamps = current
            seen.append((time.monotonic(), read_checkpoints(directory)))


def expert_survival(events: list[dict], run, seen: list[tuple[float, dict[str, int]]], directory: Path,
                    server: str) -> tuple[bool, str]:
    kills = [e["t"] for e in events if e["kind"] == "fault" and e.get("target") == server
             and e.get("fault_kind") in ("kill", "kill_restart", "restart")]
    if not kills:
        return False, f"not exercised: no fault restarts {server!r}"
    kill = run.started + kills[-1]
    before = [u for t, u in seen if t < kill]
    if not before:
        return False, f"{server!r} wrote no checkpoint before it was killed at {kills[-1]:.0f} s"
    saved, final = before[-1], read_checkpoints(directory)
    lost = {uid: (n, final.get(uid)) for uid, n in saved.items() if final.get(uid, -1) < n}
    total = sum(saved.values())
    if lost:
        return False, f"expert updates lost in the restart (before, after): {lost}"
    if sum(final.values()) <= total:  # nothing trained or saved since: the file is still the old one
        return False, f"the restarted {server!r} trained and saved nothing after the kill ({total} updates before and after)"
    return True, (f"{len(saved)} experts kept their {total} updates through the kill at {kills[-1]:.0f} s "
                  f"({sum(final.values())} at the end)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("lab-out/chaos"))
    parser.add_argument("--scenario", type=Path, default=Path(ROOT) / "swarm/testing/scenarios/chaos.toml")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--server", default="server", help="the expert server's process name in the scenario")
    args = parser.parse_args()
    from swarm.testing import report
    from swarm.testing.netns import lab_namespaces
    from swarm.testing.runner import Run
    from swarm.testing.scenario import load

    scenario = load(args.scenario)
    run = Run(scenario, args.out, live=not args.quiet)
    checkpoints = args.out / "procs" / args.server / "checkpoints"
    seen: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_checkpoints, args=(checkpoints, seen, stop), daemon=True)
    watcher.start()
    try:
        events = run.run()
    finally:
        stop.set()
        watcher.join(5)
    report.write(events, args.out, scenario.name, run.relay)
    f = report.figures(events, run.relay)
    prefix = events[0]["prefix"]
    left = lab_namespaces(prefix)
    tracebacks = [p.name for p in (args.out / "logs").glob("*.log") if "Traceback" in p.read_text(errors="replace")]
    stall, step = f["longest_stall_s"], f["median_step_s"]
    digests = f["digests"]
    survived, survival = expert_survival(events, run, seen, checkpoints, args.server)
    mismatched = ", ".join(f"epoch {e}: {len(set(p.values()))} digests" for e, p in digests["mismatched"].items())
    checks = {
        f"longest stall {stall:.1f} s <= 3 x median step {step:.1f} s": not math.isnan(stall) and stall <= 3 * step,
        f"namespaces left: {left or 'none'}": not left,
        f"crashes: {[c['proc'] for c in f['crashes']] or 'none'}": not f["crashes"],
        f"tracebacks in logs: {tracebacks or 'none'}": not tracebacks,
        f"after the last heal ({digests['after_s']:.0f} s): trainers {digests['trainers']} reach common epoch "
        f"{digests['common_epoch']}; {digests['epochs_compared']} epochs compared, digests differ: "
        f"{mismatched or 'none'}": digests["common_epoch"] is not None and not digests["mismatched"],
        f"expert parameters survive a restart: {survival}": survived,
    }
    faults = f["faults"]
    print(f"lab chaos: {len(faults)} faults over {f['seconds']:.0f} s; {f['collective_steps']} collective steps, "
          f"{f['samples']} samples; report in {args.out}")
    for what, ok in checks.items():
        print(f"  {'pass' if ok else 'FAIL'}  {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
