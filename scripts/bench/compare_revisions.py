#!/usr/bin/env python
"""Benchmark: the same collaborative-training workload on several git revisions of swarm, in turn.

Each revision is checked out into a temporary worktree (`git worktree add --detach`), and its own
`scripts/bench/bench_training.py` runs `--peers` trainers there (its own `swarm` package imported,
the current `.venv`'s packages): large-batch mode at `--target-batch` with Adam at `--lr`,
`--warmup` collective steps of warm-up, `--staleness` (0: every round waited for; 1: overlapped),
for `--seconds` of wall time. The revisions run one after another, `--repeat` times over, so load
drifting over the invocation falls on all of them alike. Per run it prints the collective steps,
the trainers' samples/s, the mean held-out loss, the seconds of CPU a trainer's peer loop and
training thread took, the seconds it waited for its group, and the DHT and averaging RPCs a trainer
made per second; then the medians per revision. Worktrees are removed at the end.

    .venv/bin/python scripts/bench/compare_revisions.py REV [REV ...] [--repeat 2] [--seconds 40]

With `--averaging "ARGS"` each revision runs its own `scripts/bench/bench_averaging.py ARGS` instead
(the all-reduce benchmark; its workers import that revision's `swarm`), in the same alternation, and
its result lines are printed prefixed by the revision:

    .venv/bin/python scripts/bench/compare_revisions.py 89795b9 HEAD --repeat 3 --averaging "--peers 4 8"

Used for changes that have no switch to turn them off in one tree (BENCHMARKS.md says which).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def worktrees(revisions: list[str]) -> Iterator[dict[str, Path]]:
    """A detached worktree of each revision, removed on the way out (also on Ctrl+C)."""
    base = Path(tempfile.mkdtemp(prefix="swarm-revisions-"))
    trees: dict[str, Path] = {}
    try:
        for rev in revisions:
            path = base / rev.replace("/", "_")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
            trees[rev] = path
        yield trees
    finally:
        for path in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
        with contextlib.suppress(OSError):
            base.rmdir()


def run(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the workload on `tree`'s code; returns the trainers' figures."""
    spec = importlib.util.spec_from_file_location(f"bench_training_{tree.name}", tree / "scripts/bench/bench_training.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    here = os.getcwd()
    os.chdir(tree)  # the workers import `swarm` from their working directory: this tree's
    try:
        spec.loader.exec_module(bench)
        results = bench.run_workers("swarm", args.peers, [
            "--max-seconds", str(args.seconds), "--threads", "1", "--target-batch-size", str(args.target_batch),
            "--lr", str(args.lr), "--warmup-steps", str(args.warmup), "--max-staleness", str(args.staleness),
            *([] if args.hidden_dim is None else ["--hidden-dim", str(args.hidden_dim)])],
            args.seconds + 180)
    finally:
        os.chdir(here)
    n = len(results)
    rpcs: dict[str, float] = {}
    for r in results:
        for method, count in r.get("rpcs", {}).items():
            if method.startswith("out "):
                rpcs[method[4:]] = rpcs.get(method[4:], 0.0) + count / n / r["elapsed"]
    return {
        "steps": results[0]["epochs"], "samples_per_s": sum(r["samples_per_s"] for r in results),
        "loss": statistics.mean(r["final_loss"] for r in results),
        "loop_cpu": statistics.mean(r["cpu"].get("peer loop", 0.0) for r in results),
        "training_cpu": statistics.mean(r["cpu"].get("training", 0.0) for r in results),
        "idle": statistics.mean(r["idle_s"] for r in results), "rpcs": rpcs,
        "failed": sum(r["failed_rounds"] for r in results), "downloads": sum(r.get("state_loads", 0) for r in results),
        "catch_ups": sum(r.get("catch_ups", 0) for r in results),  # 0 from revisions before e518d5d
        # full garbage collections per trainer and the longest (none recorded before the recorder)
        "gc_count": statistics.mean(r.get("gc_full", [0, 0.0, 0.0])[0] for r in results),
        "gc_longest": max(r.get("gc_full", [0, 0.0, 0.0])[1] for r in results),
    }


def run_averaging(tree: Path, bench_args: list[str], timeout: float) -> list[str]:
    """One run of `tree`'s own bench_averaging.py (it puts `tree` first on its path, so it and its
    workers import that tree's `swarm`); its output lines, the first saying where `swarm` came from."""
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import swarm; print(swarm.__file__)"
    where = subprocess.run([sys.executable, "-c", probe, str(tree)], cwd=tree, capture_output=True, text=True, check=True)
    done = subprocess.run([sys.executable, str(tree / "scripts/bench/bench_averaging.py"), *bench_args], cwd=tree,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench_averaging.py failed in {tree}:\n{done.stderr[-4000:]}")
    return [f"swarm imported from {where.stdout.strip()}"] + [line for line in done.stdout.splitlines() if line.strip()]


def describe(rev: str, r: dict[str, Any]) -> str:
    rpcs = ", ".join(f"{m} {v:.1f}" for m, v in sorted(r["rpcs"].items(), key=lambda kv: -kv[1]) if v >= 0.5)
    return (f"{rev}: {r['steps']} collective steps, {r['samples_per_s']:.1f} samples/s, held-out loss {r['loss']:.3f}, "
            f"per trainer: peer loop {r['loop_cpu']:.1f} s CPU, training {r['training_cpu']:.1f} s CPU, "
            f"waited {r['idle']:.1f} s; failed rounds {r['failed']:g}, state downloads {r['downloads']:g}, caught up "
            f"{r['catch_ups']:g} (all trainers); full garbage collections per trainer {r['gc_count']:.1f}, longest "
            f"{r['gc_longest']:.3f} s; RPCs made per trainer per second: {rpcs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", help="git revisions (commits, branches, tags) to compare")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--staleness", type=int, default=0, choices=(0, 1))
    parser.add_argument("--hidden-dim", type=int, default=None,
                        help="the model's width (bench_training.py --hidden-dim; 480: 9.5M parameters)")
    parser.add_argument("--averaging", default=None, metavar="ARGS",
                        help="run each revision's bench_averaging.py with these arguments (one quoted string) "
                             "instead of the training workload")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one bench_averaging.py run may take")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.averaging is not None:
        with worktrees(args.revisions) as trees:
            for attempt in range(args.repeat):
                for rev, tree in trees.items():
                    for line in run_averaging(tree, shlex.split(args.averaging), args.timeout):
                        print(f"{rev} (run {attempt + 1}): {line}", flush=True)
        print(f"load average after: {os.getloadavg()}", flush=True)
        return
    runs: dict[str, list[dict[str, Any]]] = {rev: [] for rev in args.revisions}
    with worktrees(args.revisions) as trees:
        for _ in range(args.repeat):
            for rev, tree in trees.items():
                result = run(tree, args)
                runs[rev].append(result)
                print(describe(rev, result), flush=True)
    print("medians:", flush=True)
    for rev, results in runs.items():
        median = {key: statistics.median(r[key] for r in results)
                  for key in ("steps", "samples_per_s", "loss", "loop_cpu", "training_cpu", "idle", "failed",
                              "downloads", "catch_ups", "gc_count", "gc_longest")}
        median["rpcs"] = {m: statistics.median(r["rpcs"].get(m, 0.0) for r in results)
                          for m in set().union(*(r["rpcs"] for r in results))}
        print("  " + describe(rev, median), flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
