#!/usr/bin/env python
"""Scenario 4 of the network lab: the DHT across hosts. `--nodes` `python -m swarm` daemons, each
on its own lab host, and a client-mode peer on one more host (no cache: every operation crosses
the network); every host's link has `--delay-ms` each way, so any two hosts are 4 x delay apart
(50 ms round trip by default). Prints store and get p50/p95 against one measured round trip.

    .venv/bin/python scripts/bench/lab_dht.py [--nodes 16] [--ops 100] [--delay-ms 12.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def client(args: argparse.Namespace) -> None:
    from bench_dht import latencies

    from swarm.dht.config import DHTConfig
    from swarm.peer import Peer

    peer = Peer(initial_peers=args.initial, client_mode=True, dht_config=DHTConfig(cache_size=0))
    dht = peer.dht
    peer.run(dht.aget_many([f"warm-{i}" for i in range(50)]))  # channels and handshakes to all
    lat = peer.run(latencies(dht, args.ops))
    print(json.dumps({k: lat[k] for k in ("store", "store_b2b", "get")}), flush=True)
    peer.shutdown()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=12.5)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--initial", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client(args)

    from swarm.testing import HostSpec, Lab, LinkProfile

    link = LinkProfile(delay_ms=args.delay_ms)
    hosts = [HostSpec(f"n{i}", link) for i in range(args.nodes)] + [HostSpec("client", link)]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    with Lab(hosts, seed=1) as lab:
        addrs: list[str] = []
        for i in range(args.nodes):
            argv = [py, "-m", "swarm", "--listen", f"/ip4/{lab.address(f'n{i}')}/tcp/0", "--log-level", "WARNING"]
            for a in addrs[:1]:
                argv += ["--initial-peers", a]
            proc = lab.spawn(f"n{i}", argv, stderr=subprocess.DEVNULL, env=env)
            line = proc.stdout.readline().decode().strip()
            if not line.startswith("/ip4/"):
                raise RuntimeError(f"daemon n{i} did not start")
            addrs.append(line)
        echo = lab.spawn("n0", [py, "-m", "swarm.testing.probe", "echo", lab.address("n0"), "9000"], env=env)
        echo.stdout.readline()
        rtt = json.loads(lab.exec("client", [py, "-m", "swarm.testing.probe", "rtt", lab.address("n0"), "9000",
                                             "50", "0.01"], timeout=60).stdout)
        t0 = time.monotonic()
        done = lab.exec("client", [py, os.path.abspath(__file__), "--client", "--ops", str(args.ops), "--initial",
                                   *addrs], timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stderr[-3000:]}")
        lat = json.loads(done.stdout.strip().splitlines()[-1])
        relay = lab.relay_stats()
    one = rtt["p50_ms"] / 1000
    print(f"lab DHT: {args.nodes} daemons on {args.nodes} hosts + a client host, {4 * args.delay_ms:g} ms "
          f"round trip between hosts (measured UDP p50 {rtt['p50_ms']:.1f} ms), {args.ops} ops each; "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    for name in ("store", "store_b2b", "get"):
        values = lat[name]
        p50, p95 = statistics.median(values), percentile(values, 0.95)
        print(f"  {name:<9} p50 {1000 * p50:6.1f} ms = {p50 / one:4.2f} RTT   p95 {1000 * p95:6.1f} ms = "
              f"{p95 / one:4.2f} RTT", flush=True)
    print(f"  relay: {relay['cpu_seconds']:.1f} s CPU over {relay['wall_seconds']:.0f} s, overruns {relay['overruns']}")


if __name__ == "__main__":
    main()
