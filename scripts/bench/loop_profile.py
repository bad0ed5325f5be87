#!/usr/bin/env python
"""Sorts py-spy samples of a peer's loop thread by what the loop was serving.

Reads `py-spy record --threads -f raw` files (one per trainer, e.g. taken during a
`bench_overlap.py` phase) and counts the samples of each peer loop thread (named `swarm-...`,
`swarm.core.loop`) under the first category in `CATEGORIES` whose file its stack passes through;
samples with no swarm frame below the loop's own are uvloop's C code (socket calls, epoll,
callbacks), which py-spy cannot attribute further.

    py-spy record -p PID -d 20 -r 200 --threads --nonblocking -f raw -o spy_PID.txt
    .venv/bin/python scripts/bench/loop_profile.py spy_*.txt
"""

from __future__ import annotations

import argparse
from collections import Counter

CATEGORIES = [  # checked in this order: a stack counts once, under the first that matches
    ("progress tracker", ("swarm/optim/tracker.py",)),
    ("matchmaking", ("swarm/averaging/matchmaking.py", "swarm/averaging/election.py",
                     "swarm/averaging/agreement.py")),
    ("all-reduce (parts encoded, sent, received, summed)", ("swarm/averaging/allreduce.py",
                                                             "swarm/averaging/reducer.py")),
    ("state transfer", ("swarm/averaging/state.py",)),
    ("bulk streams served (frames sealed and written)", ("swarm/net/bulk.py",)),
    ("sealed connections outside a stream (records opened, sealed records sent)", ("swarm/net/sealed.py",)),
    ("DHT", ("swarm/dht/",)),
    ("gRPC calls", ("swarm/net/calls.py",)),
    ("other swarm code", ("swarm/",)),
]


def category(frames: list[str]) -> str:
    mains = [i for i, f in enumerate(frames) if "LoopThread._main" in f]
    inner = frames[mains[-1] + 1:] if mains else frames[1:]  # below the loop's run_forever
    stack = ";".join(inner)
    for name, files in CATEGORIES:
        if any(f in stack for f in files):
            return name
    return "uvloop's own code (no Python frame below the loop)" if not inner else "other (not swarm)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="py-spy raw outputs (recorded with --threads)")
    args = parser.parse_args()
    counts: Counter[str] = Counter()
    for path in args.files:
        with open(path) as f:
            for line in f:
                stack, _, n = line.rstrip("\n").rpartition(" ")
                frames = stack.split(";")
                if not frames[0].startswith("thread") or "swarm-" not in frames[0] or not n.isdigit():
                    continue
                counts[category(frames)] += int(n)
    total = sum(counts.values())
    print(f"{total} samples of peer loop threads in {len(args.files)} file(s)")
    for name, n in counts.most_common():
        print(f"{100 * n / max(total, 1):5.1f}%  {name}")


if __name__ == "__main__":
    main()
