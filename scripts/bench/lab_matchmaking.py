#!/usr/bin/env python
"""Issue #14's matchmaking benchmark (scripts/bench/bench_matchmaking.py) in the network lab: each
peer on its own lab host, `--rtt` milliseconds between any two hosts (each host's link delays
RTT / 4 each way), `--mbit` each way. The same benchmark, the same two settings (adaptive, and the
fixed constants of before), run once per RTT in one invocation; every other option is passed on.

    .venv/bin/python scripts/bench/lab_matchmaking.py [--rtt 50 200] [--mbit 100] -- --peers 4 8 --rounds 50

Prints bench_matchmaking's JSON lines, each with the RTT it ran at.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
BENCH = os.path.join(ROOT, "scripts", "bench", "bench_matchmaking.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt", type=float, nargs="+", default=[50.0, 200.0], help="round trips to run at (ms)")
    parser.add_argument("--mbit", type=float, default=100.0, help="each host's link, each way")
    parser.add_argument("--hosts", type=int, default=0, help="hosts to build (default: the most --peers asks)")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="options for bench_matchmaking.py (after --)")
    args = parser.parse_args()
    passed = [a for a in args.bench if a != "--"]
    if "--wrap" in passed or "--listen" in passed:
        parser.error("--wrap and --listen are set here, one host per peer")
    peers = [4, 8, 16]
    if "--peers" in passed:
        i = passed.index("--peers") + 1
        peers = []
        while i < len(passed) and passed[i].isdigit():
            peers.append(int(passed[i]))
            i += 1
    hosts = args.hosts or max(peers)

    from swarm.testing import HostSpec, Lab, LinkProfile

    for rtt in args.rtt:
        link = LinkProfile(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=rtt / 4)
        with Lab([HostSpec(f"h{i}", link) for i in range(hosts)], seed=1) as lab:
            addresses = [lab.address(f"h{i}") for i in range(hosts)]
            stem = addresses[0].rsplit(".", 1)[0]
            if any(a != f"{stem}.{i + 1}" for i, a in enumerate(addresses)):
                raise SystemExit(f"lab addresses do not follow {stem}.<index + 1>: {addresses}")
            namespace = lab.namespace("h0")[:-len("h0")]
            if any(lab.namespace(f"h{i}") != f"{namespace}h{i}" for i in range(hosts)):
                raise SystemExit("lab namespaces do not follow <prefix>h<index>")
            print(f"lab matchmaking: {hosts} hosts, {rtt:g} ms RTT, {args.mbit:g} Mbit/s each way", flush=True)
            argv = [sys.executable, BENCH, *passed, "--wrap", f"ip netns exec {namespace}h{{index}}",
                    "--listen", f"/ip4/{stem}.{{host}}/tcp/0"]
            with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT}) as proc:
                assert proc.stdout is not None
                for line in proc.stdout:
                    try:
                        figures = json.loads(line)
                    except ValueError:
                        print(line, end="", flush=True)
                        continue
                    print(json.dumps({"rtt_ms": rtt, **figures}), flush=True)
            if proc.returncode:
                return proc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
