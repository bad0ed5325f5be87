#!/usr/bin/env python
"""Benchmark: the demo's held-out loss with one hostile expert server, against an all-honest run.

Runs the demo (`python -m swarm.demo`, separate processes on loopback) twice in one invocation, the
same flags each time: first all honest (one server holds the whole grid), then with the grid's last
row on a second, hostile server (`--hostile-experts MODE`, `swarm.moe.server.hostile`). One result
line per run: the held-out loss before and after, and the batches the trainers skipped; then the
hostile run's final loss over the honest one's.

    .venv/bin/python scripts/bench/bench_hostile_experts.py [--duration 60] [--trainers 2] [--modes x1e6,nan]

A full run on a quiet machine: `--duration 120 --trainers 3 --modes x1e6,nan,shape,sometimes`
(the demo's defaults, ~10 minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = re.compile(r"held-out loss\s+([0-9.]+) -> ([0-9.]+)")
CHECKS = re.compile(r"expert answers: (\d+) rejected, (\d+) of (\d+) rows clipped")


def run_demo(args: argparse.Namespace, hostile: str | None, out_dir: Path) -> tuple[float, float, int, str]:
    """(held-out loss before, after, skipped batches, what the answer checks did) of one demo run."""
    argv = [sys.executable, "-m", "swarm.demo", "--duration", str(args.duration), "--trainers", str(args.trainers),
            "--out-dir", str(out_dir)]
    if hostile is not None:
        argv += ["--hostile-experts", hostile]
    done = subprocess.run(argv, check=False, cwd=ROOT, capture_output=True, text=True, timeout=args.duration * 3 + 180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    match = HELD_OUT.search(done.stdout)
    if match is None:
        raise RuntimeError(f"the demo printed no held-out loss (status {done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    logs = "".join(p.read_text(errors="replace") for p in out_dir.rglob("trainer-*.log"))
    counts = [tuple(int(v) for v in m.groups()) for m in CHECKS.finditer(done.stdout)]
    rejected, clipped, rows = (sum(c[i] for c in counts) for i in range(3))
    checks = f"{rejected} answers rejected, {clipped} of {rows} rows clipped ({len(counts)} trainers reporting)"
    return float(match.group(1)), float(match.group(2)), logs.count("skipping a batch"), checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each demo trains")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--modes", default="x1e6", help="hostile modes, comma-separated (x1e6,nan,shape,sometimes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        honest = run_demo(args, None, Path(tmp) / "honest")
        print(f"demo {args.trainers} trainers {args.duration:.0f} s, all honest: held-out loss {honest[0]:.3f} -> "
              f"{honest[1]:.3f}, {honest[2]} batches skipped, {honest[3]}", flush=True)
        for mode in args.modes.split(","):
            before, after, skipped, checks = run_demo(args, mode, Path(tmp) / mode)
            print(f"demo {args.trainers} trainers {args.duration:.0f} s, hostile server {mode}: held-out loss "
                  f"{before:.3f} -> {after:.3f}, {skipped} batches skipped, {checks}; final loss "
                  f"{after / honest[1]:.3f}x the honest run's", flush=True)


if __name__ == "__main__":
    main()
